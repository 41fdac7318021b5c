"""Control calls issued in order without waiting for each reply (pipelining).

A sender's update is a short sequence of calls on its client: start, one or more update calls,
finish. Waiting for each reply before sending the next costs a round trip per call; the engine
runs them in order anyway. `CallQueue` issues them back to back: a client that can pipeline
(`PipelinedClient`: `rpc.RPCClient`, `FanoutClient`) puts every request on the wire at once and
matches replies by id; any other client gets one worker thread that makes its calls in
submission order. `UpdateCalls` is one update's calls on a queue, settled in order, so the
first failure (the cause) is the one reported, not the refusals that follow it.
"""

from __future__ import annotations

import contextlib
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol, cast, runtime_checkable

from wtransfer.errors import LifecycleError, TransferTimeout


@runtime_checkable
class PendingCall(Protocol):
    """One control call on its way: `result` waits for its reply."""

    def done(self) -> bool:
        """Whether the reply (or a failure) is in; never blocks."""

    def result(self, timeout_s: float) -> Any:
        """The call's result; raises its failure, or `TransferTimeout` past `timeout_s`."""

    def cancel(self) -> None:
        """Stop waiting for the reply (a late one is dropped)."""


@runtime_checkable
class PipelinedClient(Protocol):
    """A client that puts a call on the wire without waiting for the previous one's reply;
    calls made through one client run on the engine in the order they were submitted."""

    def submit(self, method: str, *, after: Any = None, **args: Any) -> PendingCall:
        """Send ``method(**args)``; returns at once. With `after` (an earlier call of this
        client) the engine side runs it only if that call succeeded."""


class FutureCall:
    """A `PendingCall` made by a worker thread (clients that cannot pipeline)."""

    def __init__(self, future: Future[Any], method: str) -> None:
        self.future = future
        self.method = method

    def done(self) -> bool:
        """Whether the call returned or raised."""
        return self.future.done()

    def result(self, timeout_s: float) -> Any:
        """The call's result; `TransferTimeout` past `timeout_s`."""
        try:
            return self.future.result(timeout=timeout_s)
        except TimeoutError as exc:
            if self.future.done():  # the call itself timed out: its own error says more
                raise
            raise TransferTimeout(f"{self.method}: no answer within {timeout_s:g}s") from exc

    def cancel(self) -> None:
        """Drop the call if it has not started."""
        self.future.cancel()


class CallQueue:
    """Calls on `client` in submission order, none waiting for the one before (see the
    module docstring)."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self._pipelined = isinstance(client, PipelinedClient)  # a protocol check: not per call
        self._pool: ThreadPoolExecutor | None = None
        self._last: Future[Any] | None = None

    def submit(self, method: str, *, after: PendingCall | None = None,
               **args: Any) -> PendingCall:
        """Issue ``client.method(**args)`` after every call submitted before it; with `after`
        (an earlier call of this queue) only if that one succeeded, else it fails with a
        `LifecycleError` saying it was skipped."""
        if self._pipelined:
            return cast(PipelinedClient, self.client).submit(method, after=after, **args)
        if after is not None and not isinstance(after, FutureCall):
            raise TypeError(f"'after' must be a call of this queue, got {after!r}")
        call = getattr(self.client, method)

        def run() -> Any:
            if after is not None and (after.future.cancelled()
                                      or after.future.exception() is not None):
                raise LifecycleError(f"{method} skipped: it was to run after {after.method}, "
                                     "which failed")
            return call(**args)

        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="wtransfer-calls")
        self._last = self._pool.submit(run)
        return FutureCall(self._last, method)

    def close(self) -> None:
        """Stop the worker thread: at once when it is idle, else once its call (which has a
        deadline of its own) returns; queued calls are dropped."""
        pool, self._pool = self._pool, None
        if pool is not None:
            idle = self._last is None or self._last.done()
            pool.shutdown(wait=idle, cancel_futures=True)


class UpdateCalls:
    """One update's calls through a `CallQueue`: start, update call(s), finish, issued without
    waiting and settled in order. A call's failure usually makes the engine refuse the calls
    after it (wrong state), so the first failure in order is the one reported."""

    def __init__(self, queue: CallQueue, timeout_s: float, weight_version: str | None,
                 sender_id: str | None = None) -> None:
        self.queue = queue
        self.timeout_s = timeout_s
        self.weight_version = weight_version
        self.sender_id = sender_id
        """Stamped on every update call: receivers refuse the calls of a replaced sender."""
        self._calls: list[PendingCall] = []
        self._settled = 0
        self.finishing = False
        """Whether finish has been issued."""

    def submit(self, method: str, **args: Any) -> PendingCall:
        """Issue a call that the engine runs only if the call before it succeeded (an update
        must not land in an update that was never opened, say, by someone else)."""
        call = self.queue.submit(method, after=self._calls[-1] if self._calls else None,
                                 **args)
        self._calls.append(call)
        return call

    def start(self) -> None:
        """Issue start."""
        self.submit("start_weight_update")

    def update(self, update_info: dict[str, Any]) -> PendingCall:
        """Issue one update call (stamped with the sender's identity)."""
        return self.submit("update_weights", update_info=self._stamped(update_info))

    def _stamped(self, update_info: dict[str, Any]) -> dict[str, Any]:
        if self.sender_id is None:
            return update_info
        return {**update_info, "sender_id": self.sender_id}

    def abort(self, reason: str, grace_s: float = 5.0) -> None:
        """Tell the engine the update failed on this side, so it fails it now instead of at
        its deadline; runs only if this update's start succeeded. Waits (up to `grace_s`) for
        the engine to take it only when every earlier call is answered: behind a call still
        running (an update blocked in its receive loop) it would wait that call's deadline."""
        answered = all(call.done() for call in self._calls)
        self.drop()  # what came before is answered or moot: the update failed
        call = self.queue.submit("update_weights", after=self._calls[0] if self._calls
                                 else None, update_info=self._stamped({"abort": reason}))
        self._calls.append(call)
        if answered:
            self._calls[-1].result(grace_s)
        self._settled = len(self._calls)

    def finish(self) -> None:
        """Issue finish (once). Issued right behind the update call(s), it waits at the
        engine, which runs it as soon as they succeed: finishing costs no round trip of its
        own."""
        if not self.finishing:
            self.finishing = True
            self.submit("finish_weight_update", weight_version=self.weight_version)

    def check(self) -> None:
        """Raise the first failure among the replies already in (never blocks): a refused
        update is seen while the data is still moving."""
        while self._settled < len(self._calls):
            call = self._calls[self._settled]
            if not call.done():
                return
            call.result(0)
            self._settled += 1

    def settle(self) -> None:
        """Wait for every issued call in order; raise the first failure (and stop waiting for
        the rest)."""
        try:
            while self._settled < len(self._calls):
                self._calls[self._settled].result(self.timeout_s)
                self._settled += 1
        except BaseException:
            self.drop()
            raise

    def cause(self, local: BaseException, grace_s: float = 5.0) -> BaseException:
        """The engine's own error for a failure seen here as `local` (the data channel breaks
        moments before the refusal's reply arrives, and the reply is the useful message), if
        it comes within `grace_s`; else `local`."""
        try:
            while self._settled < len(self._calls):
                call = self._calls[self._settled]
                try:
                    call.result(grace_s)
                except BaseException as exc:
                    return exc if call.done() else local  # not done: no reply in the grace
                self._settled += 1
        finally:
            self.drop()
        return local

    def drop(self) -> None:
        """Stop waiting for every call not yet settled."""
        for call in self._calls[self._settled:]:
            with contextlib.suppress(Exception):
                call.cancel()
        self._settled = len(self._calls)
