"""`TransferLane`: a staging replica's weight-transfer calls, on a thread of their own.

With staged updates (`EngineConfig.update_staging`), init, start and update calls run here,
off the step loop, writing only into the shadow, while the engine's own thread keeps stepping
from the live weights. A finish runs its checks here too, then hands the commit to the step
loop (`at_step_boundary`) and returns once the new weights are live. Calls run one at a time in
submission order, like every engine command.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from wtransfer.errors import TransferTimeout
from wtransfer.inference.commands import TRANSFER_COMMANDS
from wtransfer.inference.updates.replica import Replica

AtStepBoundary = Callable[[Callable[[], Any]], "Future[Any]"]
"""Runs a function on the engine's thread between two steps; its future has the result."""
RunCommand = Callable[[str, Sequence[Any]], Any]
"""Runs one of the engine's commands by name (the driver's dispatcher)."""


class TransferLane:
    """Runs `replica`'s weight-transfer commands off its step loop (see the module docstring),
    each through its driver's dispatcher `run`."""

    def __init__(self, replica: Replica, run: RunCommand, at_step_boundary: AtStepBoundary,
                 timeout_s: float) -> None:
        self.replica = replica
        self._run = run
        self._at_step_boundary = at_step_boundary
        self._timeout_s = timeout_s
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="wtransfer-lane")

    @staticmethod
    def takes(command: str) -> bool:
        """Whether `command` runs on the lane (the weight-transfer calls)."""
        return command in TRANSFER_COMMANDS

    def submit(self, command: str, args: Sequence[Any]) -> Future[Any]:
        """Run a weight-transfer command on the lane; its future has the result."""
        if command == "finish_weight_update":
            return self._pool.submit(self._finish, *args)
        return self._pool.submit(self._run, command, args)

    def _finish(self, weight_version: str | None = None) -> None:
        self.replica.finish_staged(weight_version)
        commit = self._at_step_boundary(lambda: self.replica.commit_staged(weight_version))
        try:
            commit.result(timeout=self._timeout_s)
        except FutureTimeout:
            if commit.cancel():  # (not left queued to run during a later update)
                raise TransferTimeout(f"the commit did not reach a step boundary within "
                                      f"{self._timeout_s:g}s") from None
        else:
            return
        try:  # running at a step boundary already: its outcome is the update's, and no later
            commit.result(timeout=self._timeout_s)  # call stages into the shadow before it ends
        except FutureTimeout:
            raise TransferTimeout(f"the commit began at a step boundary but did not end within "
                                  f"{self._timeout_s:g}s more") from None

    def shutdown(self) -> None:
        """Stop the lane once the call in progress (which has its deadline) returns."""
        self._pool.shutdown(wait=True, cancel_futures=True)
