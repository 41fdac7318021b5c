"""The control plane's protocol: what a sender calls on whatever holds the engines.

`WeightSyncClient` is the verbs (init, start, update, finish, fingerprint, num_workers) every
client implements (`LocalClient`, `FanoutClient`, `HTTPClient`, `rpc.RPCClient`, the vLLM and
Ray clients). A call may be issued without waiting for its reply (`PendingCall`): a client
that can put several on the wire at once is a `PipelinedClient`; `CallQueue` issues calls in
order on any client (pipelined where it can, through one ordered worker thread otherwise), so
the engine runs them in the order they were submitted without a round trip per call.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol, cast, runtime_checkable

from wtransfer.errors import LifecycleError, TransferTimeout

InitFor = Callable[[int, int], dict[str, Any]]
"""``info_for(first_worker, num_workers)``: the init info of one engine instance, given the
index of its first receiving worker among all workers and how many it has."""


@runtime_checkable
class WeightSyncClient(Protocol):
    """What a sender calls on whatever holds the receiving engine(s): one engine instance
    (`LocalClient`, `rpc.RPCClient`, `HTTPClient`) or several (`FanoutClient`); an instance has one
    or more receiving workers (its data-parallel ranks)."""

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """Initialize every receiver behind this client with the same init info."""

    def init_each_engine(self, info_for: InitFor) -> None:
        """Initialize each engine instance with its own init info, ``info_for(first_worker,
        num_workers)`` (collective backends give each engine its ranks this way)."""

    def start_weight_update(self) -> None:
        """Open an update."""

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Deliver one part of the update; returns once the receiver consumed it."""

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """Close the update and label the weights with `weight_version`."""

    def fingerprint(self) -> dict[str, str]:
        """Per-tensor digest of what the engine holds now."""

    def num_workers(self) -> int:
        """How many receiving workers this client drives in all (senders size NCCL groups and
        UCX endpoint counts by it)."""


@runtime_checkable
class PausingClient(Protocol):
    """A client that can pause its engine's generation (`HTTPClient`, the vLLM clients,
    `LocalEngineClient`, `ActorClient`): `send_weights(..., pause=mode)` pauses only around
    the commit."""

    def pause(self, mode: str = "abort", clear_cache: bool = True) -> None:
        """Pause generation: "abort", "wait" or "keep" the requests in flight."""

    def resume(self) -> None:
        """Resume generation."""


@runtime_checkable
class TwoPhaseClient(Protocol):
    """A client whose engine can check an update without making it live (our engine, our
    receivers): a `FanoutClient` stages every instance before any commits, so a fleet
    updates all or nothing."""

    def stage_weight_update(self) -> None:
        """Everything of the finish but making the update live."""

    def discard_weight_update(self, reason: str) -> None:
        """Fail the open update on purpose: nothing of it goes live."""


@runtime_checkable
class FleetClient(Protocol):
    """A client over a fleet whose membership changes (`FanoutClient`): a sender connects
    again when instances joined (or, for a transport fixed at connect, left), and in drop
    mode retries an update that failed everywhere on the instances that still answer."""

    on_failure: str
    generation: int
    """Changes of membership so far (instances added or dropped)."""
    joined: int
    """Instances added so far."""

    def take_dropped(self) -> list[str]:
        """The instances dropped since the last call (named), once."""

    def prune(self) -> bool:
        """Drop the instances that do not answer; whether any was dropped."""

    def summary(self, weight_version: str | None, dropped: Sequence[str] = ()) -> str:
        """One line about the fleet after an update."""


@runtime_checkable
class StagingClient(Protocol):
    """A client whose engine runs a finish on the thread that steps it, while the update's
    bytes are still being staged beside the steps (vLLM's staged engines load them into a
    shadow): a sender issues its finish, and any pause around it, only once `wait_staged`
    returned, so the finish is the commit alone."""

    def wait_staged(self, timeout_s: float) -> None:
        """Return once the engine has staged every byte of the open update; raise
        `TransferTimeout` past `timeout_s`."""


@runtime_checkable
class LabelledClient(Protocol):
    """A client that knows the label of the weights its engine holds (`LocalClient`, the
    inference engine's `LocalEngineClient`); `ReceiverServer.status` reports it."""

    @property
    def weight_version(self) -> str | None:
        """The label of the engine's weights."""


SPIN_S = 0.002
"""Longest a side polls without sleeping for what it expects soon (a reply, the end of its
copies), before it is due: a thread woken from a sleep can take a few hundred microseconds
to run again on an idle host (measured on one H200's host)."""
SPIN_WINDOW_S = 5 * SPIN_S
"""How long after it starts such polling goes on; what comes later than that is waited for
by sleeping again (a stuck peer never holds a core busy until the deadline)."""


def spin_start(started: float, expected_s: float | None) -> float | None:
    """When a wait that began at `started` (monotonic seconds) and is expected to last
    `expected_s` (the last one's time; None: no expectation) starts polling without sleeping:
    a tenth of that, at most `SPIN_S`, before it is due."""
    if not expected_s:
        return None
    return started + expected_s - min(0.1 * expected_s, SPIN_S)


def spinning(spin_from: float | None, now: float) -> bool:
    """Whether a wait that expects its event from `spin_from` on (monotonic seconds; None:
    not expected) polls without sleeping at `now` (see `SPIN_WINDOW_S`)."""
    return spin_from is not None and spin_from <= now < spin_from + SPIN_WINDOW_S


@runtime_checkable
class PendingCall(Protocol):
    """One control call on its way: `result` waits for its reply."""

    def done(self) -> bool:
        """Whether the reply (or a failure) is in; never blocks."""

    def result(self, timeout_s: float, spin_from: float | None = None) -> Any:
        """The call's result; raises its failure, or `TransferTimeout` past `timeout_s`. From
        `spin_from` on (monotonic seconds: when the reply is expected soon) a client that
        polls for replies polls without sleeping, so the reply is seen the moment it lands
        (senders pass it by keyword, and only when they have an expectation)."""

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

    def result(self, timeout_s: float, spin_from: float | None = None) -> Any:
        """The call's result; `TransferTimeout` past `timeout_s` (`spin_from` is moot: the
        worker thread's future wakes this one)."""
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
