"""A receiver's control plane in another process: msgpack request/response over ZeroMQ.

`ReceiverServer` serves a receiver (a `WeightTransferEngine`, or anything speaking the
`WeightSyncClient` protocol) on a background thread; `RPCClient` is the trainer's end and is
itself a `WeightSyncClient`. Every call has a deadline (`TransferTimeout`); an exception on the
serving side comes back as `PeerError` carrying the remote type and message.

Wire format (`wtransfer.wire`): a request is the body ``{"method": str, "args": {...}}``
after an envelope that ends with an empty frame; the reply repeats the envelope, then
``{"ok": true, "result": ...}`` or ``{"ok": false, "type": str, "message": str}``. A REQ socket
makes the envelope itself; `RPCClient` (DEALER) sends ``[call id (8 bytes), b"", body]``, which
lets it keep several calls in flight and match each reply to its call.
"""

from __future__ import annotations

import collections
import contextlib
import inspect
import os
import queue
import select
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from wtransfer import wire
from wtransfer.control.clients import LocalClient, SingleEngineClient, check_workers
from wtransfer.errors import (
    ConfigError,
    LifecycleError,
    MetadataError,
    TransferTimeout,
    error_reply,
    ok_reply,
    reply_result,
)
from wtransfer.protocol import (
    SPIN_WINDOW_S,
    LabelledClient,
    TwoPhaseClient,
    WeightSyncClient,
    spinning,
)
from wtransfer.receiver.engine import WeightTransferEngine
from wtransfer.transport.channel import Channel

SERVED = ("init_weight_transfer_engine", "start_weight_update", "update_weights",
          "finish_weight_update", "fingerprint", "num_workers")
TWO_PHASE = ("stage_weight_update", "discard_weight_update")
"""The `TwoPhaseClient` methods a `ReceiverServer` serves too."""
"""The `WeightSyncClient` methods a `ReceiverServer` serves (`init_each_engine` is
`init_weight_transfer_engine` for the one engine a server fronts), plus "status"."""

_METHODS: dict[str, tuple[str, ...]] = {
    **{name: tuple(inspect.signature(getattr(WeightSyncClient, name)).parameters)[1:]
       for name in SERVED},
    **{name: tuple(inspect.signature(getattr(TwoPhaseClient, name)).parameters)[1:]
       for name in TWO_PHASE},
    "status": (),
}
_POLL_MS = 100
_SERVING_THREAD = "wtransfer-rpc-io"
_FAILED_KEPT = 4096
_SLICE_S = 0.005
"""Longest a waiting `RPCClient` thread holds its socket before letting others use it."""


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _cuda_bytes() -> int:
    """Bytes this process holds in CUDA allocations (0 where CUDA was never initialized)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return 0
    return sum(int(torch.cuda.memory_allocated(d)) for d in range(torch.cuda.device_count()))


class ReceiverServer:
    """Serves a receiver's weight-sync calls at `address` (``tcp://host:0`` picks a port). Calls
    that change the receiver run one at a time in arrival order; `status` is answered at once,
    even during a long `update_weights`."""

    def __init__(
        self,
        engine: WeightTransferEngine[Any, Any] | WeightSyncClient,
        address: str = "tcp://127.0.0.1:0",
        *,
        max_message_bytes: int = wire.MAX_MESSAGE_BYTES,
    ) -> None:
        self.client: WeightSyncClient = (
            LocalClient(engine) if isinstance(engine, WeightTransferEngine) else engine
        )
        self.engine = engine if isinstance(engine, WeightTransferEngine) else None
        self._max = max_message_bytes
        try:
            self._socket = Channel.serve(address, max_message_bytes=max_message_bytes)
        except ConfigError as exc:
            raise ConfigError(f"receiver server: {exc}") from None
        self.address: str = self._socket.address
        """The bound address, with the real port; give it to `RPCClient`."""
        self._lock = threading.Lock()
        """Guards the socket: the serving thread reads requests, and the worker thread sends
        its replies itself (a ZeroMQ socket is not thread-safe)."""
        self._reading = threading.Lock()
        """Held while requests are read and dispatched (see `_read_requests`)."""
        self._ready_fd = self._socket.fd
        """Readable when the socket's state may have changed (then `readable` says what)."""
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        """The worker thread's nudge to the serving thread: a send of its may have taken the
        socket's readable signal while a request was waiting (and `close`'s, to stop)."""
        self._work: queue.SimpleQueue[
            tuple[list[bytes], str, dict[str, Any], bytes | None] | None] = queue.SimpleQueue()
        self._failed: collections.OrderedDict[tuple[bytes, ...], None] = \
            collections.OrderedDict()
        """Recent calls (envelope without its delimiter) that failed or were skipped, for
        requests that run only `after` another one succeeded."""
        self._stop = threading.Event()
        self._closing = threading.Lock()
        """Makes `close`'s check-and-set of `_stop` one step."""
        self._threads: list[threading.Thread] = []

    def start(self) -> ReceiverServer:
        """Serve on background threads; returns self."""
        self._threads = [
            threading.Thread(target=self._serve, name=_SERVING_THREAD, daemon=True),
            threading.Thread(target=self._execute, name="wtransfer-rpc-exec", daemon=True),
        ]
        for thread in self._threads:
            thread.start()
        return self

    def _serve(self) -> None:
        """Read and dispatch requests until closed. It waits on the socket's signal file
        descriptor, not on the socket, so the worker thread can send replies in between
        without a hand-over (waking this thread to forward a reply took 0.1-0.2 ms on one
        H200's host)."""
        waiting = select.poll()
        waiting.register(self._ready_fd, select.POLLIN)
        waiting.register(self._wake_r, select.POLLIN)
        while not self._stop.is_set():
            if self._read_requests(nudge=False):
                continue  # read again until none waits: only then does the signal re-arm
            if any(fd == self._wake_r for fd, _ in waiting.poll(_POLL_MS)):
                with contextlib.suppress(BlockingIOError):  # (a nudge: requests are read at
                    os.read(self._wake_r, 4096)  # the top)
        with self._lock:
            self._socket.close()  # (the wake-up pipe is `close`'s to close)

    def _read_requests(self, *, nudge: bool) -> bool:
        """Read and dispatch every request waiting (either thread may: they take turns, so
        requests are dispatched in arrival order); whether there was any. The worker thread
        passes `nudge`: the replies it sends here (status, errors) may take the signal of a
        request that arrives meanwhile, as its call replies may (see `_send`)."""
        with self._reading:
            with self._lock:
                requests = list(self._socket.waiting()) if not self._socket.closed else []
            for frames in requests:
                self._accept(frames, nudge=nudge)
        return bool(requests)

    def _next_call(self, soon: bool) -> tuple[list[bytes], str, dict[str, Any],
                                              bytes | None] | None:
        """The next queued call, waiting for it. When one is expected `soon` (after a start), this
        thread first reads the socket itself, without sleeping, for up to `protocol.SPIN_WINDOW_S`,
        so the call starts without two thread wake-ups."""
        if soon:
            until = time.monotonic() + SPIN_WINDOW_S
            while self._work.empty() and time.monotonic() < until \
                    and not self._stop.is_set():
                if not self._read_requests(nudge=True):
                    os.sched_yield()
        return self._work.get()

    def _send(self, frames: list[bytes], *, nudge: bool = False) -> None:
        """Send a reply; a ROUTER drops it if its caller is gone. With `nudge` (the worker
        thread), wake the serving thread when a request waits: the send may have taken the
        socket's signal of it (the serving thread itself reads everything before it waits)."""
        with self._lock:
            if self._socket.closed:
                return
            self._socket.send(frames)
            if nudge and self._socket.readable():
                self._wake()

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError):  # (a full pipe wakes it all the same)
            os.write(self._wake_w, b"!")

    def _accept(self, frames: list[bytes], *, nudge: bool) -> None:
        if b"" not in frames:
            return  # no envelope: nothing to answer to
        split = frames.index(b"")
        envelope, body = frames[: split + 1], frames[split + 1 :]
        try:
            method, args, after = self._parse(body)
            if after is not None and len(envelope) < 3:
                raise MetadataError("'after' names a call by id: send [call id, b'', request] "
                                    "from a DEALER socket")
        except Exception as exc:
            self._send([*envelope, wire.encode(error_reply(exc))], nudge=nudge)
            return
        if method == "status":
            try:
                reply = wire.encode(ok_reply(self.status()))
            except Exception as exc:  # (the caller hears why; this thread keeps serving)
                reply = wire.encode(error_reply(exc))
            self._send([*envelope, reply], nudge=nudge)
        else:
            self._work.put((envelope, method, args, after))

    def _parse(self, body: list[bytes]) -> tuple[str, dict[str, Any], bytes | None]:
        if len(body) != 1:
            raise MetadataError(f"expected one frame per request, got {len(body)}")
        request = wire.decode(body[0], max_bytes=self._max)
        if not isinstance(request, dict) or not {"method", "args"} <= set(request) <= {
                "method", "args", "after"}:
            raise MetadataError("request must be {'method': str, 'args': map} (and optionally "
                                "'after': the id of an earlier call of this client)")
        method, args, after = request["method"], request["args"], request.get("after")
        if method not in _METHODS or not isinstance(args, dict):
            raise MetadataError(f"unknown method {method!r}; known: {sorted(_METHODS)}")
        if set(args) - set(_METHODS[method]):
            raise MetadataError(f"{method}: unexpected arguments {sorted(args)}")
        if after is not None and not (isinstance(after, int) and 0 <= after < 1 << 64):
            raise MetadataError(f"'after' must be a call id (an int >= 0), got {after!r}")
        return method, args, None if after is None else after.to_bytes(8, "little")

    def _execute(self) -> None:
        """Run the queued calls in order, sending each reply from this thread. A reply is held back
        while the same caller's finish, already queued, runs next, and goes out with the finish's;
        after a start the next call is read without sleeping (`_next_call`)."""
        held: list[list[bytes]] = []
        item = self._work.get()
        started = False  # whether the last call opened an update
        while item is not None:
            envelope, method, args, after = item
            key = tuple(envelope[:-1])
            try:
                if after is not None and (*key[:-1], after) in self._failed:
                    raise LifecycleError(f"{method} skipped: it was sent to run after call "
                                         f"{int.from_bytes(after, 'little')}, which failed")
                reply = wire.encode(ok_reply(getattr(self.client, method)(**args)))
                started = method == "start_weight_update"
            except Exception as exc:  # (a result that cannot be encoded too: this thread
                reply = wire.encode(error_reply(exc))  # serves on, the caller hears why)
                started = False
                self._failed[key] = None
                while len(self._failed) > _FAILED_KEPT:
                    self._failed.popitem(last=False)
            held.append([*envelope, reply])
            waiting = not self._work.empty()
            item = self._work.get() if waiting else None
            if item is not None and item[1] == "finish_weight_update" \
                    and item[0][0] == envelope[0]:
                continue  # (the same caller: a DEALER's identity frame)
            for frames in held:
                self._send(frames, nudge=True)
            held = []
            if not waiting:
                item = self._next_call(soon=started)
        for frames in held:
            self._send(frames, nudge=True)

    def status(self) -> dict[str, Any]:
        """State of the served receiver (plain data; what `RPCClient.status()` returns)."""
        out: dict[str, Any] = {"pid": os.getpid(), "rss_bytes": _rss_bytes(),
                               "cuda_bytes": _cuda_bytes(), "threads": threading.active_count(),
                               "weight_version": self.client.weight_version
                               if isinstance(self.client, LabelledClient) else None}
        if self.engine is not None:
            out.update(state=self.engine.state.value, torn=self.engine.torn,
                       failure=self.engine.failure,
                       last_update_bytes=self.engine.last_update_bytes,
                       last_update_seconds=self.engine.last_update_seconds)
        return out

    def close(self) -> None:
        """Stop serving and release the socket and the wake-up pipe (a call in progress
        finishes first, for up to 5 s; a serving thread still running then keeps the pipe
        open); idempotent and safe from several threads at once (a call that finds another
        closing returns at once)."""
        with self._closing:
            if self._stop.is_set():
                return
            self._stop.set()
        self._work.put(None)
        self._wake()
        for thread in self._threads:
            thread.join(timeout=5)
        with self._lock:
            self._socket.close()  # (when never started; else the serving thread did)
        if not any(t.is_alive() for t in self._threads if t.name == _SERVING_THREAD):
            os.close(self._wake_r)  # (the worker writes only while the socket is open; were
            os.close(self._wake_w)  # the poller still running, a reused number would be
            # another file's, so then they are left open)


class RPCCall:
    """One request of an `RPCClient` in flight (a `wtransfer.trainer.calls.PendingCall`)."""

    def __init__(self, client: RPCClient, call_id: int, method: str, deadline: float,
                 timeout_s: float) -> None:
        self.client = client
        self.call_id = call_id
        self.method = method
        self.deadline = deadline
        """When the call gives up (monotonic seconds): its submission plus the timeout."""
        self.timeout_s = timeout_s
        self._reply: bytes | None = None

    def done(self) -> bool:
        """Whether the reply is in; never blocks."""
        if self._reply is None and self.client._arrived(self.call_id):
            self._take(0.0)
        return self._reply is not None

    def _take(self, deadline: float, spin_from: float | None = None) -> None:
        """Wait (until `deadline`) for the reply; several threads may wait on one call (a
        fleet's finish and its sender): whichever reads it files it here for all."""
        reply = self.client._collect(self.call_id, deadline, spin_from,
                                     taken=lambda: self._reply is not None)
        if reply is not None:
            self._reply = reply

    def result(self, timeout_s: float | None = None, spin_from: float | None = None) -> Any:
        """The call's result; `PeerError` (typed by the remote error) if it failed there,
        `TransferTimeout` once its deadline, or `timeout_s` from now, passes first. From
        `spin_from` (monotonic seconds) on, the socket is polled without sleeping."""
        if self._reply is None:
            deadline = self.deadline if timeout_s is None else min(
                self.deadline, time.monotonic() + timeout_s)
            self._take(deadline, spin_from)
            if self._reply is None:
                waited = self.timeout_s if deadline == self.deadline else timeout_s
                raise TransferTimeout(self.client._silence(self.method, waited or 0.0))
        return reply_result(wire.decode(self._reply),
                            f"{self.method} failed on {self.client.address}")

    def cancel(self) -> None:
        """Stop waiting: a reply that comes later is dropped."""
        if self._reply is None:
            self.client._forget(self.call_id)


class RPCClient(SingleEngineClient):
    """The trainer's end of a `ReceiverServer`: a `WeightSyncClient` with deadlines, safe to share
    between threads. Several calls may be in flight (`submit`; the server runs them in arrival
    order); a reply that comes after its caller gave up is dropped."""

    def __init__(self, address: str, *, timeout_s: float = 60.0) -> None:
        if timeout_s <= 0:
            raise ConfigError(f"timeout_s must be positive, got {timeout_s}")
        self.address = address
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        """Guards the socket and the reply table (a ZeroMQ socket is not thread-safe)."""
        self._next_id = 0
        self._waiting: set[int] = set()
        self._replies: dict[int, bytes] = {}
        try:
            self._socket = Channel.connect(address)
        except ConfigError as exc:
            raise ConfigError(f"RPCClient: {exc}") from None

    def submit(self, method: str, *, after: RPCCall | None = None,
               timeout_s: float | None = None, **args: Any) -> RPCCall:
        """Send ``method(**args)`` without waiting for the reply (see `RPCCall`); calls from one
        client run on the receiver in submission order. With `after` (an earlier call of this
        client) the receiver runs it only if that call succeeded, else refuses it with a
        `LifecycleError` saying so: an update never lands in an update that was not opened."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        request: dict[str, Any] = {"method": method, "args": args}
        if after is not None:
            if after.client is not self:
                raise ConfigError("'after' must be a call of the same client")
            request["after"] = after.call_id
        payload = wire.encode(request)
        deadline = time.monotonic() + timeout
        with self._lock:
            if self._socket.closed:
                raise LifecycleError(f"{method}: this RPCClient to {self.address} was closed; "
                                     "create a new one")
            call_id, self._next_id = self._next_id, self._next_id + 1
            frames = [call_id.to_bytes(8, "little"), b"", payload]
            while not self._socket.send(frames, block=False):  # queue full: the receiver is
                left = deadline - time.monotonic()  # not reading
                if left <= 0 or not self._socket.wait(int(left * 1000) + 1, writable=True):
                    raise TransferTimeout(self._silence(method, timeout)) from None
            self._waiting.add(call_id)
        return RPCCall(self, call_id, method, deadline, timeout)

    def call(self, method: str, *, timeout_s: float | None = None, **args: Any) -> Any:
        """Invoke `method` remotely; `TransferTimeout` past the deadline, `PeerError` on failure."""
        pending = self.submit(method, timeout_s=timeout_s, **args)
        try:
            return pending.result()
        finally:
            pending.cancel()

    def _silence(self, method: str, timeout_s: float) -> str:
        return (f"{method}: no answer from {self.address} within {timeout_s:g}s; is the "
                "receiver process alive?")

    def _collect(self, call_id: int, deadline: float, spin_from: float | None = None,
                 taken: Callable[[], bool] | None = None) -> bytes | None:
        """The reply body of `call_id` once in, or None at `deadline`. The waiter files every reply
        that arrives by id and gives the lock up every few ms; from `spin_from`, for
        `protocol.SPIN_WINDOW_S`, it polls without sleeping."""
        while True:
            with self._lock:
                if call_id in self._replies:
                    return self._replies.pop(call_id)
                if taken is not None and taken():
                    return None  # another thread took it for the same call
                now = time.monotonic()
                left = deadline - now
                if left <= 0:
                    return None
                spin = spinning(spin_from, now)
                wait_s = min(left, _SLICE_S)
                if spin_from is not None and now < spin_from:  # awake in time to poll so
                    wait_s = min(wait_s, spin_from - now)
                timeout_ms = 0 if spin else max(1, int(wait_s * 1000))
                if self._socket.wait(timeout_ms):
                    self._read_replies()
                    continue
            if spin:
                os.sched_yield()

    def _arrived(self, call_id: int) -> bool:
        """Whether `call_id`'s reply is in (reads what is waiting; never blocks)."""
        with self._lock:
            if call_id not in self._replies and self._socket.wait(0):
                self._read_replies()
            return call_id in self._replies

    def _read_replies(self) -> None:
        for frames in self._socket.waiting():
            if len(frames) != 3 or len(frames[0]) != 8 or frames[1] != b"":
                continue  # not an answer to any request of ours
            call_id = int.from_bytes(frames[0], "little")
            if call_id in self._waiting:
                self._waiting.discard(call_id)
                self._replies[call_id] = frames[2]

    def _forget(self, call_id: int) -> None:
        with self._lock:
            self._waiting.discard(call_id)
            self._replies.pop(call_id, None)

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """Initialize the remote receiver."""
        self.call("init_weight_transfer_engine", init_info=init_info)

    def start_weight_update(self) -> None:
        """Open an update remotely."""
        self.call("start_weight_update")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Deliver one part of the update; returns once the receiver consumed it."""
        self.call("update_weights", update_info=update_info)

    def stage_weight_update(self) -> None:
        """Check the open update remotely without making it live."""
        self.call("stage_weight_update")

    def discard_weight_update(self, reason: str) -> None:
        """Fail the open update remotely, on purpose."""
        self.call("discard_weight_update", reason=reason)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """Finish the update remotely and label the weights."""
        self.call("finish_weight_update", weight_version=weight_version)

    def fingerprint(self) -> dict[str, str]:
        """Per-tensor digest of what the remote receiver holds."""
        result = self.call("fingerprint")
        if not isinstance(result, dict):
            raise MetadataError("fingerprint reply is not a map")
        return result

    def status(self) -> dict[str, Any]:
        """The remote receiver's state, version, failure and memory use."""
        result = self.call("status")
        if not isinstance(result, dict):
            raise MetadataError("status reply is not a map")
        return result

    def num_workers(self) -> int:
        """Receiving workers behind the served object (an engine's data-parallel ranks)."""
        return check_workers(self, self.call("num_workers"))

    def close(self) -> None:
        """Close the socket (after any other thread's socket operation in progress)."""
        with self._lock:
            self._socket.close()
            self._waiting.clear()
            self._replies.clear()

    def __repr__(self) -> str:
        return f"RPCClient({self.address!r})"
