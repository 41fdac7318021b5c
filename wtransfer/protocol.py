"""The control plane's protocol: what a sender calls on whatever holds the engines.

`WeightSyncClient` is the verbs (init, start, update, finish, fingerprint, num_workers) every
client implements (`LocalClient`, `FanoutClient`, `HTTPClient`, `rpc.RPCClient`, the vLLM and
Ray clients). A call may be issued without waiting for its reply (`PendingCall`): a client
that can put several on the wire at once is a `PipelinedClient`; `CallQueue` issues calls in
order on any client (pipelined where it can, through one ordered worker thread otherwise), so
the engine runs them in the order they were submitted without a round trip per call.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, cast, runtime_checkable

from wtransfer.errors import LifecycleError, PeerError, TransferTimeout

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


class BatchRefused(PeerError):
    """A `BatchingClient`'s batch that the engine side did not take, nothing of it run (no
    such route, too large): `CallQueue` sends its calls one by one instead, and no more
    batches to this client when `lasting`."""

    def __init__(self, reason: str, *, lasting: bool) -> None:
        super().__init__(reason)
        self.lasting = lasting


@runtime_checkable
class BatchingClient(Protocol):
    """A client that can carry several calls in one request (`HTTPClient` to `wtransfer
    serve`): `CallQueue` hands it the calls that wait together, so a lone sender's start,
    update and finish cost one round trip."""

    def can_batch(self, method: str) -> bool:
        """Whether `method` may travel in a batch (a client that batches no start batches
        nothing: `CallQueue` then sends every call alone)."""

    def call_batch(self, calls: Sequence[BatchedCall]) -> Iterator[BaseException | None]:
        """Run `calls` on the engine in order, each only if its `after` (the index of an
        earlier call of the batch) succeeded; yields each call's failure (None: it
        succeeded) as its answer arrives. Raises `BatchRefused` before the first answer
        when nothing of the batch ran, and any other error when the request failed."""


class BatchedCall(NamedTuple):
    """One call of a batch: the method, its keyword arguments, and the index of the call of
    the same batch it runs after (only if that one succeeded; None: unconditionally)."""

    method: str
    args: dict[str, Any]
    after: int | None


@dataclass
class _Queued:
    future: Future[Any]
    method: str
    args: dict[str, Any]
    after: FutureCall | None


class CallQueue:
    """Calls on `client` in submission order, none waiting for the one before (see the
    module docstring). A client that cannot pipeline gets them through one worker thread,
    which takes every call waiting when it is free: several go in one request to a
    `BatchingClient`, and `held` keeps calls waiting so they go together."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self._pipelined = isinstance(client, PipelinedClient)  # a protocol check: not per call
        self._batching = (not self._pipelined and isinstance(client, BatchingClient)
                          and client.can_batch("start_weight_update"))
        self._waiting: list[_Queued] = []
        self._holds = 0
        self._busy = False
        self._closed = False
        self._ready = threading.Condition()
        self._thread: threading.Thread | None = None

    def submit(self, method: str, *, after: PendingCall | None = None,
               **args: Any) -> PendingCall:
        """Issue ``client.method(**args)`` after every call submitted before it; with `after`
        (an earlier call of this queue) only if that one succeeded, else it fails with a
        `LifecycleError` saying it was skipped."""
        if self._pipelined:
            return cast(PipelinedClient, self.client).submit(method, after=after, **args)
        if after is not None and not isinstance(after, FutureCall):
            raise TypeError(f"'after' must be a call of this queue, got {after!r}")
        getattr(self.client, method)  # an unknown method fails here, not on the thread
        future: Future[Any] = Future()
        with self._ready:
            if self._closed:
                raise LifecycleError(f"{method}: this call queue was closed")
            self._waiting.append(_Queued(future, method, args, after))
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="wtransfer-calls",
                                                daemon=True)
                self._thread.start()
            self._ready.notify()
        return FutureCall(future, method)

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Calls submitted inside wait until it ends, then go together in one request (a
        client that does not batch gets them at once, as without it; a pipelined client
        with a `held` of its own, a `FanoutClient`, holds its instances' calls)."""
        own = getattr(self.client, "held", None) if self._pipelined else None
        if own is not None:
            with own():
                yield
            return
        if not self._batching:
            yield
            return
        with self._ready:
            self._holds += 1
        try:
            yield
        finally:
            with self._ready:
                self._holds -= 1
                self._ready.notify()

    def _serve(self) -> None:
        """The worker thread: every call waiting (and not held) in turn, in order."""
        while True:
            with self._ready:
                self._busy = False
                while not self._closed and (self._holds or not self._waiting):
                    self._ready.wait()
                if self._closed:
                    return
                taken, self._waiting = self._waiting, []
                self._busy = True
            self._run(taken)

    def _run(self, taken: list[_Queued]) -> None:
        """Run `taken` in order: in one batch where the client batches them all, else one
        by one, each marked running just before it runs (a call cancelled before that never
        runs); a call whose `after` failed, or was cancelled, is skipped."""
        client = self.client
        if not (self._batching and len(taken) > 1
                and all(client.can_batch(q.method) for q in taken)):
            for queued in taken:
                if queued.future.set_running_or_notify_cancel():
                    self._run_one(queued)
            return
        batch: list[BatchedCall] = []
        sent: list[_Queued] = []
        position: dict[int, int] = {}
        for queued in taken:  # (all go at once: each is running from here)
            if not queued.future.set_running_or_notify_cancel():
                continue
            after = queued.after
            if after is not None and id(after.future) not in position and _failed(after):
                queued.future.set_exception(skipped(queued.method, after.method))
                continue
            index = position.get(id(after.future)) if after is not None else None
            position[id(queued.future)] = len(batch)
            batch.append(BatchedCall(queued.method, queued.args, index))
            sent.append(queued)
        if len(sent) > 1:
            try:
                self._run_batch(batch, sent)
                return
            except BatchRefused as refused:  # nothing of it ran: each call alone instead
                self._batching = self._batching and not refused.lasting  # (running already:
                # these calls can no longer be cancelled, as in a batch)
        for queued in sent:
            self._run_one(queued)

    def _run_one(self, queued: _Queued) -> None:
        """One call alone (marked running), unless its `after` failed."""
        after = queued.after
        if after is not None and _failed(after):
            queued.future.set_exception(skipped(queued.method, after.method))
            return
        try:
            queued.future.set_result(getattr(self.client, queued.method)(**queued.args))
        except BaseException as exc:
            queued.future.set_exception(exc)

    def _run_batch(self, batch: list[BatchedCall], sent: list[_Queued]) -> None:
        """One request carrying `batch`; each call's answer settles its future as it comes,
        and a failure of the request fails every call not yet answered (`BatchRefused`
        before the first answer goes to the caller: nothing ran)."""
        answered = 0
        try:
            for failure in self.client.call_batch(batch):
                future = sent[answered].future
                if failure is None:
                    future.set_result(None)
                else:
                    future.set_exception(failure)
                answered += 1
            if answered != len(sent):
                raise PeerError(f"the engine answered {answered} of the {len(sent)} calls "
                                "of a batch")
        except BatchRefused as refused:
            if not answered:
                raise
            failed: BaseException = PeerError(f"a batch was refused after {answered} of its "
                                              f"calls ran: {refused}")
            for queued in sent[answered:]:
                queued.future.set_exception(failed)
        except BaseException as exc:
            for queued in sent[answered:]:
                queued.future.set_exception(exc)

    def close(self) -> None:
        """Stop the worker thread: at once when it is idle, else once its calls (each with a
        deadline of its own) return; waiting calls are dropped."""
        with self._ready:
            self._closed = True
            dropped, self._waiting = self._waiting, []
            thread, busy = self._thread, self._busy
            self._ready.notify()
        for queued in dropped:
            queued.future.cancel()
        if thread is not None and not busy:
            thread.join()


def _failed(call: FutureCall) -> bool:
    return call.future.cancelled() or (call.future.done()
                                        and call.future.exception() is not None)


def skipped(method: str, after: str) -> LifecycleError:
    """The failure of a call not run because the one it was to run after failed."""
    return LifecycleError(f"{method} skipped: it was to run after {after}, which failed")
