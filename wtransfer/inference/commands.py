"""The engine's command set, defined once.

`EngineCommands` is every call a front end may make on an engine replica; each runs on the
replica's own thread, between two steps, so a pause or an update never lands in the middle of
a forward pass. `Replica` implements it; `EngineCore` (one replica on a thread) and the
data-parallel front end and ranks serve it by name through `CoreClient.submit`; `AsyncEngine`
and `LocalEngineClient` are its asyncio and blocking faces.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import AsyncGenerator, Callable, Sequence
from concurrent.futures import Future
from typing import Any, Protocol

from wtransfer.errors import ConfigError, LifecycleError, TransferTimeout
from wtransfer.inference.config import EngineConfig
from wtransfer.inference.outputs import OutputSnapshot, RequestOutput
from wtransfer.inference.params import SamplingParams
from wtransfer.protocol import skipped
from wtransfer.records import PauseMode


class EngineCommands(Protocol):
    """Every command an engine replica serves (see the module docstring)."""

    def add_request(self, request_id: str, prompt: list[int],
                    params: SamplingParams | dict[str, Any], capture_kv: bool = False) -> None:
        """Queue a request; refused (nothing else touched) when invalid or its id is live;
        with `capture_kv` its prompt's K/V is kept at its first token (`take_captured`)."""

    def add_prefilled(self, request_id: str, prompt: list[int],
                      params: SamplingParams | dict[str, Any], token: int, logprob: float,
                      version: str, kv: Any) -> str:
        """A request prefilled by a prefill instance: decoded from its K/V under the same
        weight version, else prefilled here; "remote" or "local"."""

    def take_captured(self, request_id: str) -> dict[str, Any] | None:
        """A captured prompt's K/V, first token and version, once."""

    def abort(self, request_ids: list[str] | None) -> int:
        """Finish the given requests (all when None) with finish_reason "abort"."""

    def pause(self, mode: PauseMode, clear_cache: bool) -> Future[None]:
        """Apply a pause; the returned future completes once the pause holds."""

    def resume(self) -> None:
        """Leave the pause; refused while an update is open or the weights are torn."""

    def is_paused(self) -> bool:
        """Whether a pause is in effect."""

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """Create (once) and initialize the configured backend's receiver."""

    def start_weight_update(self) -> None:
        """Open an update (in place: the engine must be paused or idle; staged: any time)."""

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Receive one part of the update."""

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """Complete the update and, in the same step, relabel the weights."""

    def stage_weight_update(self) -> None:
        """Everything of the finish but making the update live (a fleet stages every
        instance before any commits)."""

    def discard_weight_update(self, reason: str) -> None:
        """Fail the open update on purpose (another instance failed it): nothing goes live."""

    def push_weights(self, address: str, backend: str, init_fields: dict[str, Any]
                     ) -> dict[str, Any]:
        """Send the live weights, as a trainer would, to the receiver served at `address` (a
        new instance joining from this one); their version and fingerprint."""

    def reserve_rollback(self) -> None:
        """Hold a rollback ready (every rank able; `LifecycleError` naming the one that is
        not): data-parallel ranks all reserve before any rolls back."""

    def rollback_weights(self, reserved: bool = False) -> None:
        """Swap the previous weight version back in (staged swap updates); `reserved`: after
        `reserve_rollback`."""

    def release_rollback(self) -> None:
        """Give up a reserved rollback (another rank could not roll back)."""

    def update_weight_version(self, version: str) -> None:
        """Relabel the current weights."""

    def get_weight_version(self) -> str:
        """The current weight label ("default" until the first update)."""

    def fingerprint(self) -> dict[str, str]:
        """Per-tensor digest of the served weights."""

    def weight_info(self) -> dict[str, Any]:
        """Version, update state and whether the weights are torn (see `Replica`)."""

    def stats(self) -> dict[str, Any]:
        """Counters for metrics and benchmarks."""


COMMANDS: frozenset[str] = frozenset(
    name for name, value in vars(EngineCommands).items()
    if callable(value) and not name.startswith("_"))
"""The names of `EngineCommands`: what `CoreClient.submit` accepts."""


def check_command(command: str) -> None:
    """`ConfigError` unless `command` is one of `COMMANDS`."""
    if command not in COMMANDS:
        raise ConfigError(f"unknown engine command {command!r}; known: {sorted(COMMANDS)}")


def check_engine_call(command: str, args: Sequence[Any]) -> None:
    """`check_command`, and `ConfigError` for the steps of a rollback that only a
    data-parallel front end sends its ranks (`reserve_rollback`, `release_rollback`,
    `rollback_weights(reserved=True)`): an engine's callers roll back in one call."""
    check_command(command)
    if command in ("reserve_rollback", "release_rollback") or (
            command == "rollback_weights" and args and args[0]):
        raise ConfigError(f"{command} with {list(args)} is a data-parallel rank's step of "
                          f"rollback_weights, not a call to an engine; call "
                          f"rollback_weights()")


TRANSFER_COMMANDS: frozenset[str] = frozenset({
    "init_weight_transfer_engine", "start_weight_update", "update_weights",
    "stage_weight_update", "discard_weight_update", "finish_weight_update",
    "push_weights"})
"""The commands a staging replica runs on its transfer lane, off the step loop."""


def run_command(target: object, command: str, args: Sequence[Any]) -> Any:
    """Run one of `COMMANDS` on `target` (a replica, or a driver answering some itself): the
    one dispatcher every driver of a replica uses (the engine thread, a data-parallel rank)."""
    check_command(command)
    return getattr(target, command)(*args)


Chained = tuple[str, Sequence[Any], int | None]
"""One command of a chain: its name, its arguments, and the index of the earlier command of
the chain it runs after, only if that one succeeded (None: whatever came before)."""


class Chain:
    """`commands` run one after another through `submit` (a `CoreClient`'s), each submitted by
    the thread that completes the one before it (an `EngineCore` runs them all between the
    same two steps); `futures` holds each command's outcome, in order. A command whose `after`
    failed is skipped (its future fails with a `LifecycleError` saying so); `stop` keeps every
    command not yet submitted from running."""

    def __init__(self, submit: Callable[..., Future[Any]],
                 commands: Sequence[Chained]) -> None:
        self.futures: list[Future[Any]] = [Future() for _ in commands]
        self._submit = submit
        self._commands = list(commands)
        self._lock = threading.Lock()
        self._stopped: str | None = None
        self._running: Future[Any] | None = None
        self._next = 0
        """The first command not yet submitted."""
        self._launch(0)

    def stop(self, reason: str) -> None:
        """No command not yet submitted runs (each fails at once with a `LifecycleError`
        naming `reason`); the one submitted is cancelled at the engine if it has not started
        (its future then says it never ran)."""
        with self._lock:
            self._stopped = reason
            running, unsent = self._running, self.futures[self._next:]
            for index, future in enumerate(unsent, start=self._next):
                if not future.done():
                    future.set_exception(LifecycleError(
                        f"{self._commands[index][0]} never ran: {reason}"))
        if running is not None:
            running.cancel()

    def _launch(self, index: int) -> None:
        while index < len(self._commands):
            command, args, after = self._commands[index]
            mine = self.futures[index]
            with self._lock:  # (a stop either comes first, or sees what it must cancel)
                self._next = index + 1
                if self._stopped is not None:  # (its future failed in `stop`)
                    return
                if after is not None and _failed(self.futures[after]):
                    mine.set_exception(skipped(command, self._commands[after][0]))
                    index += 1
                    continue
                try:
                    running = self._running = self._submit(command, *args)
                except Exception as exc:
                    mine.set_exception(exc)
                    index += 1
                    continue
            index += 1
            if not running.done():  # (one done already is settled here: no recursion)
                running.add_done_callback(functools.partial(self._settled, index))
                return
            _settle(mine, command, running)

    def _settled(self, following: int, running: Future[Any]) -> None:
        _settle(self.futures[following - 1], self._commands[following - 1][0], running)
        self._launch(following)


def _failed(done: Future[Any]) -> bool:
    """Whether a done future failed (cancelled counts: it never ran)."""
    return done.cancelled() or done.exception() is not None


def _settle(mine: Future[Any], command: str, running: Future[Any]) -> None:
    """`mine` takes the outcome of `running` (done)."""
    if running.cancelled():
        mine.set_exception(LifecycleError(f"{command} never ran: it was cancelled before it "
                                          "started"))
    elif (exc := running.exception()) is not None:
        mine.set_exception(exc)
    else:
        mine.set_result(running.result())


async def chained(submit: Callable[..., Future[Any]], commands: Sequence[Chained],
                  timeout_s: float) -> AsyncGenerator[BaseException | None, None]:
    """A `Chain` of `commands` on an event loop: yields each command's failure (None: it
    succeeded) as it completes, in order. A command not done within `timeout_s` is a
    `TransferTimeout`, and nothing behind it that was not yet submitted runs (each of those
    says it never ran); closing the generator early (its reader went away) stops them too."""
    run = Chain(submit, commands)
    try:
        for (command, _, _), future in zip(commands, run.futures, strict=True):
            waiting = asyncio.wrap_future(future)
            waiting.add_done_callback(_retrieved)
            done, _ = await asyncio.wait({waiting}, timeout=timeout_s)
            if not done:
                run.stop(f"{command} before it did not complete within {timeout_s:g}s")
                yield TransferTimeout(f"{command} did not complete within {timeout_s:g}s (it "
                                      "may still complete)")
            else:
                yield waiting.exception()
    finally:
        run.stop("the batch's reader went away")


def _retrieved(waiting: asyncio.Future[Any]) -> None:
    """(A failure nobody awaits any more is not reported as never retrieved.)"""
    if not waiting.cancelled():
        waiting.exception()


class CoreClient(Protocol):
    """What `AsyncEngine` drives: `EngineCore` here, or `DataParallelCore` over N processes."""

    config: EngineConfig

    def submit(self, command: str, *args: Any) -> Future[Any]:
        """Run one of `COMMANDS`; "pause" resolves to a second future that completes once the
        pause holds."""

    def failure(self) -> str | None:
        """Why the engine cannot serve any more (its loop or a rank died), or None."""

    def shutdown(self) -> None:
        """Abort live requests and stop."""


Emit = Callable[[RequestOutput | OutputSnapshot], None]
"""Receives every request's cumulative output after each step that changed it (a step's
tokens as an `OutputSnapshot`, built when read)."""
