"""The single-process engine core: one `Replica` driven by a thread of its own.

Everything that touches the scheduler or the weights runs on that thread, between steps:
requests, aborts, pause/resume and every weight-transfer call arrive as commands
(`submit(name, ...)`, one of `wtransfer.inference.commands.COMMANDS`, returns a
`concurrent.futures.Future`), so a pause or an update never lands in the middle of a forward
pass.

A failure inside a step ends only that step's requests (see `Replica.step`). A failure of the
loop itself means the engine cannot go on: it says so at once (`failure()`), every live request
ends with finish_reason "error", and every pending and later call raises `EngineDeadError`;
nothing waits on a thread that is gone.
"""

from __future__ import annotations

import logging
import threading
import warnings
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from wtransfer.errors import EngineDeadError, LifecycleError
from wtransfer.inference.commands import Emit, check_engine_call, run_command
from wtransfer.inference.config import EngineConfig
from wtransfer.inference.updates.replica import Replica
from wtransfer.inference.updates.transfer_lane import TransferLane

log = logging.getLogger("wtransfer.engine")

CHAINED_PER_GAP = 64
"""Rounds of commands one gap between two steps runs: those that arrived, then those they
chained (a batch of weight-sync calls, each submitted as the one before completes), and so on;
a steady stream of commands never starves the steps."""


class EngineCore:
    """One model replica (`replica`) with its own thread (see the module docstring)."""

    def __init__(self, config: EngineConfig, emit: Emit) -> None:
        self.config = config
        self.replica = Replica(config, emit)
        """The model, KV cache, scheduler and receiver this thread drives."""
        self._commands: deque[tuple[Callable[..., Any], tuple[Any, ...], Future[Any]]] = deque()
        self._wake = threading.Condition()
        self._stopped = False
        self._failure: str | None = None
        self._lane = (TransferLane(self.replica, self._run_command, self.call,
                                   config.call_timeout_s)
                      if self.replica.staging is not None else None)
        """Where a staging engine's weight-transfer calls run (off the step loop)."""
        self._thread = threading.Thread(target=self._thread_main, name="wtransfer-engine-core",
                                        daemon=True)
        self._thread.start()

    def __getattr__(self, name: str) -> Any:
        """The replica's public state read through the core, as before the core held it
        (deprecated: read `core.replica.<name>`)."""
        replica = self.__dict__.get("replica")
        if replica is None or name.startswith("_"):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        warnings.warn(f"EngineCore.{name} is the replica's: read core.replica.{name}",
                      DeprecationWarning, stacklevel=2)
        return getattr(replica, name)

    def failure(self) -> str | None:
        """Why the engine cannot serve any more, or None while it can."""
        return self._failure

    def call(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        """Run `fn(*args)` on the engine thread between steps."""
        future: Future[Any] = Future()
        with self._wake:
            if self._failure is not None:
                future.set_exception(EngineDeadError(f"the engine stopped: {self._failure}"))
            elif self._stopped:
                future.set_exception(LifecycleError("the engine is shut down"))
            else:
                self._commands.append((fn, args, future))
                self._wake.notify()
        return future

    def submit(self, command: str, *args: Any) -> Future[Any]:
        """Run the named command (one of `COMMANDS`) on the engine thread."""
        check_engine_call(command, args)  # refused at once, not on the engine thread
        if self._lane is not None and self._lane.takes(command) and self._failure is None:
            return self._lane.submit(command, args)
        return self.call(self._run_command, command, args)

    def _run_command(self, command: str, args: Sequence[Any]) -> Any:
        self.replica.settle_failure()  # a rank's watchdog may have failed an update just now
        return run_command(self.replica, command, args)

    def _thread_main(self) -> None:
        try:
            self._loop()
        except BaseException as exc:
            log.exception("the engine loop failed; the engine cannot serve any more")
            self._die(f"{type(exc).__name__}: {exc}")

    def _loop(self) -> None:
        while True:
            with self._wake:
                if not self._commands and not self._stopped and not self.replica.can_step():
                    self._wake.wait(0.5)  # or look again (an update failed by its watchdog)
                if self._stopped and not self._commands:
                    return
                commands = list(self._commands)
                self._commands.clear()
            self.replica.settle_failure()
            ran = False
            for rounds in range(1, CHAINED_PER_GAP + 1):
                ran = ran or bool(commands)
                for fn, args, future in commands:
                    if future.set_running_or_notify_cancel():
                        try:
                            future.set_result(fn(*args))
                        except Exception as exc:
                            future.set_exception(exc)
                if rounds == CHAINED_PER_GAP:
                    break  # (what arrived since waits for the next gap, still queued)
                with self._wake:  # those the commands chained (`commands.Chain`): this gap
                    commands = list(self._commands)
                    self._commands.clear()
                if not commands:
                    break
            replica = self.replica
            if replica.can_step():
                replica.step()
            elif not ran:  # idle: tensor-parallel workers hear from rank 0 anyway
                replica.keep_workers_alive()
            replica.resolve_drains()

    def _die(self, reason: str) -> None:
        """Fail everything that waits on this engine (see the module docstring)."""
        dead = EngineDeadError(f"the engine stopped: {reason}")
        with self._wake:
            self._failure = reason
            pending, self._commands = list(self._commands), deque()
        for _, _, future in pending:
            if future.set_running_or_notify_cancel():
                future.set_exception(dead)
        self.replica.fail_everything(dead)

    def shutdown(self) -> None:
        """Abort every request, stop the thread and release the receiver."""
        if self._failure is None:
            done = self.call(self.replica.abort, None)
            with self._wake:
                self._stopped = True
                self._wake.notify()
            try:
                done.exception(timeout=self.config.step_timeout_s)
            except FutureTimeout:
                log.warning("shutdown: live requests were not aborted within %gs",
                            self.config.step_timeout_s)
            self._thread.join(timeout=self.config.step_timeout_s)
        if self._lane is not None:
            self._lane.shutdown()
        # a step still running keeps its model
        self.replica.close(release=not self._thread.is_alive())
