"""A receiver's control plane in another process: msgpack request/response over ZeroMQ.

`ReceiverServer` serves a receiver (a `WeightTransferEngine`, or anything speaking the
`WeightSyncClient` protocol) on a background thread; `RPCClient` is the trainer's end and is
itself a `WeightSyncClient`. Every call has a deadline (`TransferTimeout`); an exception on the
serving side comes back as `PeerError` carrying the remote type and message.

Wire format (both directions, one frame, `wtransfer.wire`):
request ``{"method": str, "args": {...}}``; reply ``{"ok": true, "result": ...}`` or
``{"ok": false, "type": str, "message": str}``.
"""

from __future__ import annotations

import inspect
import os
import queue
import sys
import threading
import time
from typing import Any

import zmq

from wtransfer import wire
from wtransfer.clients import LocalClient, SingleEngineClient, check_workers
from wtransfer.errors import (
    ConfigError,
    MetadataError,
    TransferTimeout,
    error_reply,
    from_reply,
)
from wtransfer.receiver import WeightTransferEngine
from wtransfer.sender import WeightSyncClient

SERVED = ("init_weight_transfer_engine", "start_weight_update", "update_weights",
          "finish_weight_update", "fingerprint", "num_workers")
"""The `WeightSyncClient` methods a `ReceiverServer` serves (`init_each_engine` is
`init_weight_transfer_engine` for the one engine a server fronts), plus "status"."""

_METHODS: dict[str, tuple[str, ...]] = {
    **{name: tuple(inspect.signature(getattr(WeightSyncClient, name)).parameters)[1:]
       for name in SERVED},
    "status": (),
}
_POLL_MS = 100


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
    """Serves a receiver's weight-sync calls at `address` (``tcp://host:0`` picks a port).

    Calls that change the receiver run one at a time, in arrival order, on a worker thread;
    `status` is answered at once even while a long `update_weights` is running, so a watcher
    (or a health check) never waits behind a transfer.
    """

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
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._socket: zmq.Socket[bytes] = ctx.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        bind = address[:-2] + ":*" if address.startswith("tcp://") and address.endswith(":0") \
            else address
        try:
            self._socket.bind(bind)
        except zmq.ZMQError as exc:
            self._socket.close()
            raise ConfigError(f"cannot bind receiver server to {address!r}: {exc}") from None
        self.address: str = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        """The bound address, with the real port; give it to `RPCClient`."""
        self._replies_at = f"inproc://wtransfer-rpc-{id(self)}"
        self._replies: zmq.Socket[bytes] = ctx.socket(zmq.PULL)
        self._replies.bind(self._replies_at)
        self._work: queue.Queue[tuple[list[bytes], str, dict[str, Any]] | None] = queue.Queue()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> ReceiverServer:
        """Serve on background threads; returns self."""
        self._threads = [
            threading.Thread(target=self._serve, name="wtransfer-rpc-io", daemon=True),
            threading.Thread(target=self._execute, name="wtransfer-rpc-exec", daemon=True),
        ]
        for thread in self._threads:
            thread.start()
        return self

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        poller.register(self._replies, zmq.POLLIN)
        while not self._stop.is_set():
            ready = dict(poller.poll(_POLL_MS))
            if self._replies in ready:
                self._socket.send_multipart(self._replies.recv_multipart())
            if self._socket in ready:
                self._accept(self._socket.recv_multipart())
        self._socket.close()
        self._replies.close()

    def _accept(self, frames: list[bytes]) -> None:
        if b"" not in frames:
            return  # not a REQ envelope: nothing to answer to
        split = frames.index(b"")
        envelope, body = frames[: split + 1], frames[split + 1 :]
        try:
            method, args = self._parse(body)
        except Exception as exc:
            self._socket.send_multipart([*envelope, wire.encode(error_reply(exc))])
            return
        if method == "status":
            self._socket.send_multipart([*envelope, wire.encode(
                {"ok": True, "result": self.status()})])
        else:
            self._work.put((envelope, method, args))

    def _parse(self, body: list[bytes]) -> tuple[str, dict[str, Any]]:
        if len(body) != 1:
            raise MetadataError(f"expected one frame per request, got {len(body)}")
        request = wire.decode(body[0], max_bytes=self._max)
        if not isinstance(request, dict) or set(request) != {"method", "args"}:
            raise MetadataError("request must be {'method': str, 'args': map}")
        method, args = request["method"], request["args"]
        if method not in _METHODS or not isinstance(args, dict):
            raise MetadataError(f"unknown method {method!r}; known: {sorted(_METHODS)}")
        if set(args) - set(_METHODS[method]):
            raise MetadataError(f"{method}: unexpected arguments {sorted(args)}")
        return method, args

    def _execute(self) -> None:
        out: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUSH)
        out.setsockopt(zmq.LINGER, 0)
        out.connect(self._replies_at)
        while True:
            item = self._work.get()
            if item is None:
                break
            envelope, method, args = item
            try:
                reply = {"ok": True, "result": getattr(self.client, method)(**args)}
            except Exception as exc:
                reply = error_reply(exc)
            out.send_multipart([*envelope, wire.encode(reply)])
        out.close()

    def status(self) -> dict[str, Any]:
        """State of the served receiver (plain data; what `RPCClient.status()` returns)."""
        out: dict[str, Any] = {"pid": os.getpid(), "rss_bytes": _rss_bytes(),
                               "cuda_bytes": _cuda_bytes(), "threads": threading.active_count(),
                               "weight_version": getattr(self.client, "weight_version", None)}
        if self.engine is not None:
            out.update(state=self.engine.state.value, torn=self.engine.torn,
                       failure=self.engine.failure,
                       last_update_bytes=self.engine.last_update_bytes,
                       last_update_seconds=self.engine.last_update_seconds)
        return out

    def close(self) -> None:
        """Stop serving and release the sockets (a call in progress finishes first)."""
        self._stop.set()
        self._work.put(None)
        for thread in self._threads:
            thread.join(timeout=5)
        if not self._threads:
            self._socket.close()
            self._replies.close()


class RPCClient(SingleEngineClient):
    """The trainer's end of a `ReceiverServer`; a `WeightSyncClient` with deadlines."""

    def __init__(self, address: str, *, timeout_s: float = 60.0) -> None:
        if timeout_s <= 0:
            raise ConfigError(f"timeout_s must be positive, got {timeout_s}")
        self.address = address
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._socket = self._connect()

    def _connect(self) -> zmq.Socket[bytes]:
        sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(self.address)
        except zmq.ZMQError as exc:
            sock.close()
            raise ConfigError(f"bad receiver address {self.address!r}: {exc}") from None
        return sock

    def call(self, method: str, *, timeout_s: float | None = None, **args: Any) -> Any:
        """Invoke `method` remotely; `TransferTimeout` past the deadline, `PeerError` on failure."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        payload = wire.encode({"method": method, "args": args})
        with self._lock:
            deadline = time.monotonic() + timeout
            try:
                self._wait(zmq.POLLOUT, deadline, method)
                self._socket.send(payload, zmq.NOBLOCK)
                self._wait(zmq.POLLIN, deadline, method)
                reply = wire.decode(self._socket.recv())
            except TransferTimeout:
                self._socket.close()
                self._socket = self._connect()  # a REQ socket is unusable after a lost reply
                raise
        if not isinstance(reply, dict) or not isinstance(reply.get("ok"), bool):
            raise MetadataError(f"malformed reply from {self.address}: {reply!r:.200}")
        if reply["ok"]:
            return reply.get("result")
        raise from_reply(reply, f"{method} failed on {self.address}")

    def _wait(self, event: int, deadline: float, method: str) -> None:
        left = deadline - time.monotonic()
        if left <= 0 or not self._socket.poll(int(left * 1000) + 1, event):
            raise TransferTimeout(f"{method}: no answer from {self.address} within "
                                  f"{self.timeout_s:g}s; is the receiver process alive?")

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """Initialize the remote receiver."""
        self.call("init_weight_transfer_engine", init_info=init_info)

    def start_weight_update(self) -> None:
        """Open an update remotely."""
        self.call("start_weight_update")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Deliver one part of the update; returns once the receiver consumed it."""
        self.call("update_weights", update_info=update_info)

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
        """Close the socket."""
        self._socket.close()

    def __repr__(self) -> str:
        return f"RPCClient({self.address!r})"
