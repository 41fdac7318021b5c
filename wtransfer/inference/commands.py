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
from collections.abc import AsyncGenerator, Callable, Sequence
from concurrent.futures import Future, InvalidStateError
from typing import Any, Protocol

from wtransfer.errors import ConfigError, LifecycleError, TransferTimeout
from wtransfer.inference.config import EngineConfig
from wtransfer.inference.outputs import OutputSnapshot, RequestOutput
from wtransfer.inference.params import SamplingParams
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


def chain(submit: Callable[..., Future[Any]], commands: Sequence[Chained]) -> list[Future[Any]]:
    """Run `commands` one after another through `submit` (a `CoreClient`'s), each submitted
    by the thread that completes the one before it (an `EngineCore` runs them all between the
    same two steps); their futures, in order. Cancelling a future before its command runs
    keeps it from running (the engine's own future is cancelled too); a command whose `after`
    failed or was cancelled never runs (its future fails with a `LifecycleError` saying it was
    skipped)."""
    futures: list[Future[Any]] = [Future() for _ in commands]

    def launch(index: int) -> None:
        while index < len(commands):
            command, args, after = commands[index]
            mine = futures[index]
            index += 1
            if mine.cancelled():  # its waiter gave up: not run
                continue
            if after is not None and _failed(futures[after]):
                _set(mine, exception=LifecycleError(
                    f"{command} skipped: it was to run after {commands[after][0]}, which "
                    f"{'was cancelled' if futures[after].cancelled() else 'failed'}"))
                continue
            try:
                running = submit(command, *args)
            except Exception as exc:
                _set(mine, exception=exc)
                continue
            mine.add_done_callback(functools.partial(_cancel_with, running))
            if not running.done():  # (one done already is settled here: no recursion)
                running.add_done_callback(functools.partial(settled, index))
                return
            _settle(mine, command, running)

    def settled(following: int, running: Future[Any]) -> None:
        _settle(futures[following - 1], commands[following - 1][0], running)
        launch(following)

    launch(0)
    return futures


def _cancel_with(running: Future[Any], mine: Future[Any]) -> None:
    """`mine` done: if its waiter cancelled it, the engine's `running` is cancelled too (a
    command not yet started never runs)."""
    if mine.cancelled():
        running.cancel()


def _settle(mine: Future[Any], command: str, running: Future[Any]) -> None:
    """`mine` takes the outcome of `running` (done), unless its waiter gave up on it."""
    if running.cancelled():
        _set(mine, exception=LifecycleError(f"{command} was cancelled before it ran"))
    elif (exc := running.exception()) is not None:
        _set(mine, exception=exc)
    else:
        _set(mine, result=running.result())


def _set(future: Future[Any], *, result: Any = None,
         exception: BaseException | None = None) -> None:
    """Settle `future` unless it was cancelled (its waiter gave up: nobody reads it)."""
    try:
        if exception is not None:
            future.set_exception(exception)
        else:
            future.set_result(result)
    except InvalidStateError:
        pass


def _failed(future: Future[Any]) -> bool:
    return future.cancelled() or (future.done() and future.exception() is not None)


async def chained(submit: Callable[..., Future[Any]], commands: Sequence[Chained],
                  timeout_s: float) -> AsyncGenerator[BaseException | None, None]:
    """`chain(submit, commands)` on an event loop: yields each command's failure (None: it
    succeeded) as it completes, in order. A command not done within `timeout_s` is a
    `TransferTimeout`, and it (if it has not started) and every command behind it never run;
    closing the generator early (its reader went away) stops those not yet started too."""
    futures = chain(submit, commands)
    try:
        for (command, _, _), future in zip(commands, futures, strict=True):
            if future.cancelled():  # (behind a command that ran past its deadline)
                yield LifecycleError(f"{command} skipped: a call before it did not complete "
                                     "in time")
                continue
            waiting = asyncio.wrap_future(future)
            done, _ = await asyncio.wait({waiting}, timeout=timeout_s)
            if not done:
                waiting.cancel()
                for later in futures:
                    later.cancel()  # (the engine's own future too, where not yet running)
                yield TransferTimeout(f"{command} did not complete within {timeout_s:g}s")
            elif waiting.cancelled():
                yield LifecycleError(f"{command} was cancelled before it ran")
            else:
                yield waiting.exception()
    finally:
        for future in futures:
            future.cancel()


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
