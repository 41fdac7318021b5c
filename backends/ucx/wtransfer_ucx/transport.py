"""A small synchronous layer over UCXX's low-level API: one worker with a progress thread,
tagged sends and receives of flat uint8 tensors, length-prefixed control messages, and waits
with deadlines."""

from __future__ import annotations

import contextlib
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch

from wtransfer.errors import MetadataError, PeerError, TransferTimeout

_POLL_S = 0.0002

MAX_INFLIGHT = 16
"""Messages in flight at once per side: staging slots bound the packed ones; direct ones need
no staging, and keeping several in flight hides each rendezvous round trip."""


MAX_MESSAGE_BYTES = 1 << 30
"""The largest control message a peer may announce (`UCXWorker.recv_message`)."""


def tag(session: int, update: int, bucket: int) -> int:
    """The 64-bit tag of one bucket: session (16 bits), update (16 bits), bucket (32 bits)."""
    return (session & 0xFFFF) << 48 | (update & 0xFFFF) << 32 | (bucket & 0xFFFFFFFF)


def control_tag(session: int, kind: int, worker: int) -> int:
    """The tag of a control message of `kind` (1..63) to or from `worker`: update 0 and the
    bucket's top bit set, so no bucket's tag is ever one (buckets number below 2**31); each
    message uses it and the next (`UCXWorker.send_message`)."""
    return tag(session, 0, 1 << 31 | kind << 25 | (worker & 0xFFFFFF) << 1)


def _array(tensor: torch.Tensor) -> Any:
    from ucxx._lib.arr import Array

    return Array(tensor if tensor.is_cuda else tensor.numpy())


def context_options() -> dict[str, str]:
    """UCX options wtransfer sets unless the environment sets them.

    `CUDA_IPC_ENABLE_GET_ZCOPY=y`: UCX lets cuda_ipc serve one-sided reads only where it finds
    active NVLinks on GPU 0 (so not on a one-GPU machine, nor over PCIe); elsewhere a read of
    GPU memory falls back to software emulation over TCP, about 100x slower. Writes are not
    affected either way. A UCX without the cuda_ipc transport loaded refuses the option.
    """
    wanted = {"CUDA_IPC_ENABLE_GET_ZCOPY": "y"}
    return {name: value for name, value in wanted.items() if f"UCX_{name}" not in os.environ}


def cuda_ipc_reads(loaded: bool) -> bool:
    """Whether a UCX that `loaded` its cuda_ipc transport reads GPU memory through it: not
    when `UCX_TLS` leaves cuda_ipc out, nor when `UCX_CUDA_IPC_ENABLE_GET_ZCOPY` says other
    than yes (UCX then emulates reads where it finds no NVLink, ~100x slower)."""
    if not loaded:
        return False
    zcopy = os.environ.get("UCX_CUDA_IPC_ENABLE_GET_ZCOPY")
    if zcopy is not None and zcopy.strip().lower() not in ("y", "yes", "1", "on", "true"):
        return False
    tls = os.environ.get("UCX_TLS")
    if tls is None:
        return True
    names = {t.strip() for t in tls.lstrip("^").split(",")}
    named = bool(names & {"cuda_ipc", "cuda", "all"})
    return not named if tls.startswith("^") else named


class Outbox:
    """A message `UCXWorker.send_message` is sending: its requests, and the buffers they read
    (alive until the requests completed)."""

    def __init__(self, requests: list[Any], buffers: list[torch.Tensor]) -> None:
        self.requests = requests
        self._buffers = buffers


class UCXWorker:
    """A UCX context and worker progressed by UCXX's own thread (polling mode)."""

    def __init__(self) -> None:
        import ucxx._lib.libucxx as ucx_api

        self.api = ucx_api
        features = (ucx_api.Feature.TAG, ucx_api.Feature.RMA)
        options = context_options()
        try:
            self.context = ucx_api.UCXContext(config_dict=options, feature_flags=features)
            loaded = bool(options)  # the cuda_ipc option was taken: cuda_ipc is loaded
        except ucx_api.UCXInvalidParamError:  # this UCX has no cuda_ipc (no CUDA here)
            self.context = ucx_api.UCXContext(feature_flags=features)
            loaded = False
        self.worker = ucx_api.UCXWorker(self.context)
        self.cuda_ipc = cuda_ipc_reads(loaded or "cuda_ipc" in self.transports())
        """Whether this UCX serves reads of GPU memory on one host through cuda_ipc (the
        peers are assumed to run the same UCX with the same environment)."""
        self.worker.start_progress_thread(polling_mode=True)
        self.progressing = True
        self.endpoints: list[Any] = []
        self.closed_endpoints = 0
        """Endpoints of the current connection set that closed (a peer left)."""
        self._generation = 0
        self._lock = threading.Lock()
        self._listener: Any = None

    def transports(self) -> str:
        """UCX's description of the worker and its transports (for logs and notes)."""
        return str(self.worker.info)

    def listen(self, port: int) -> int:
        """Accept connections on `port` (0: any); returns the bound port."""
        me = weakref.ref(self)  # UCXX keeps its callbacks out of the collector's sight: a

        def accept(conn_request: Any) -> None:  # strong reference would keep us alive
            worker = me()
            if worker is not None and worker._listener is not None:
                worker._watch(worker.api.UCXEndpoint.create_from_conn_request(
                    worker._listener, conn_request, True))

        self._listener = self.api.UCXListener.create(self.worker, port, accept)
        return int(self._listener.port)

    def connect(self, address: str, port: int) -> Any:
        """An endpoint to a listening peer."""
        ep = self.api.UCXEndpoint.create(self.worker, address, port, True)
        self._watch(ep)
        return ep

    def _watch(self, ep: Any) -> None:
        generation, me = self._generation, weakref.ref(self)

        def gone(*_: Any) -> None:
            worker = me()
            if worker is None:
                return
            with worker._lock:
                if generation == worker._generation:  # not an endpoint already let go
                    worker.closed_endpoints += 1

        ep.set_close_callback(gone)
        with self._lock:
            self.endpoints.append(ep)

    def wait_for_endpoints(self, count: int, timeout_s: float) -> list[Any]:
        """Block until `count` peers connected."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                if len(self.endpoints) >= count:
                    return list(self.endpoints)
            if time.monotonic() > deadline:
                raise TransferTimeout(f"only {len(self.endpoints)} of {count} worker(s) "
                                      f"connected within {timeout_s:g}s")
            time.sleep(0.001)

    def send(self, ep: Any, data: torch.Tensor, tag_value: int) -> Any:
        """Start a tagged send of flat uint8 `data` (it must stay alive until done)."""
        try:
            return ep.tag_send(_array(data), self.api.UCXXTag(tag_value))
        except Exception as exc:  # UCXX raises its own types when the peer is gone
            raise PeerError(f"UCX send failed (peer gone?): {type(exc).__name__}: {exc}") \
                from None

    def recv(self, data: torch.Tensor, tag_value: int) -> Any:
        """Start a tagged receive into flat uint8 `data`."""
        try:
            return self.worker.tag_recv(_array(data), self.api.UCXXTag(tag_value))
        except Exception as exc:
            raise PeerError(f"UCX receive failed: {type(exc).__name__}: {exc}") from None

    def address(self) -> bytes:
        """This worker's UCX address: a peer that has it can open an endpoint to it
        (`connect_to_address`)."""
        return bytes(self.worker.address.tobytes())

    def connect_to_address(self, address: bytes) -> Any:
        """An endpoint to the worker whose `address` this is."""
        try:
            ep = self.api.UCXEndpoint.create_from_worker_address(
                self.worker, self.api.UCXAddress.create_from_buffer(bytearray(address)), True)
        except Exception as exc:
            raise PeerError(f"UCX could not reach a peer by its worker address: "
                            f"{type(exc).__name__}: {exc}") from None
        self._watch(ep)
        return ep

    def send_message(self, ep: Any, payload: bytes, tag_value: int) -> Outbox:
        """Start sending `payload` to `ep` as two tagged messages, its length (`tag_value`)
        then its bytes (`tag_value + 1`), for `recv_message`; wait on the returned `Outbox`
        (it holds the buffers until they are sent)."""
        header = torch.tensor([len(payload)], dtype=torch.int64).view(torch.uint8)
        body = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        return Outbox([self.send(ep, header, tag_value), self.send(ep, body, tag_value + 1)],
                      [header, body])

    def recv_message(self, tag_value: int, timeout_s: float, what: str) -> bytes:
        """The message `send_message` sent with `tag_value`; `TransferTimeout` naming `what`
        when it does not come within `timeout_s`, `MetadataError` for a length that is not
        1..`MAX_MESSAGE_BYTES`."""
        deadline = time.monotonic() + timeout_s
        header = torch.zeros(1, dtype=torch.int64)
        self._recv_by(header.view(torch.uint8), tag_value, deadline, what)
        nbytes = int(header.item())
        if not 0 < nbytes <= MAX_MESSAGE_BYTES:
            raise MetadataError(f"{what}: the peer announced a message of {nbytes} bytes "
                                f"(at most {MAX_MESSAGE_BYTES})")
        body = torch.empty(nbytes, dtype=torch.uint8)
        self._recv_by(body, tag_value + 1, deadline, what)
        return body.numpy().tobytes()

    def _recv_by(self, data: torch.Tensor, tag_value: int, deadline: float, what: str) -> None:
        try:
            self.wait([self.recv(data, tag_value)], max(0.0, deadline - time.monotonic()))
        except TransferTimeout:
            raise TransferTimeout(f"{what} did not arrive in time (is the peer alive?)") \
                from None

    def wait(self, requests: list[Any], timeout_s: float,
             check: Callable[[], None] | None = None) -> None:
        """Wait for every request; `PeerError` if one failed or a peer left, `TransferTimeout`
        past the deadline (the requests are then cancelled)."""
        deadline = time.monotonic() + timeout_s
        pending = list(requests)
        while pending:
            pending = [r for r in pending if not r.completed]
            for req in requests:
                if req.completed:
                    try:
                        req.check_error()
                    except Exception as exc:
                        raise PeerError(f"UCX transfer failed (peer gone?): "
                                        f"{type(exc).__name__}: {exc}") from None
            if not pending:
                return
            if check is not None:
                check()
            self.check_peers()
            if time.monotonic() > deadline:
                self.worker.cancel_inflight_requests()
                raise TransferTimeout(f"UCX transfer did not complete within {timeout_s:g}s: "
                                      "a peer is gone or stalled")
            time.sleep(_POLL_S)

    def check_peers(self) -> None:
        """`PeerError` if a peer closed its endpoint (it left or died)."""
        if self.closed_endpoints:
            raise PeerError("a UCX peer closed its endpoint mid-transfer")

    def disconnect(self) -> None:
        """Close every endpoint, keeping the context and worker for the next peers (a UCX
        context costs megabytes that are not all returned when it is destroyed)."""
        with self._lock:
            endpoints, self.endpoints = self.endpoints, []
            self._generation += 1
            self.closed_endpoints = 0
        for ep in endpoints:
            if ep.alive:  # closing an endpoint whose peer died crashes inside UCXX
                with contextlib.suppress(Exception):
                    ep.close()

    def close(self) -> None:
        """Close endpoints, stop listening and stop the progress thread."""
        self.disconnect()
        self._listener = None
        if self.progressing:
            self.progressing = False
            with contextlib.suppress(Exception):
                self.worker.stop_progress_thread()


_idle: list[UCXWorker] = []
_idle_lock = threading.Lock()


def acquire_worker() -> UCXWorker:
    """A worker for one sender or receiver: one an earlier user released when there is one.

    UCXX does not give back all of a worker's memory once it has had endpoints (about 5 MiB
    each, measured), so a process that creates a sender per update would grow without
    bound; reusing idle workers keeps it flat. A worker serves one user at a time."""
    with _idle_lock:
        worker = _idle.pop() if _idle else None
    if worker is None:
        return UCXWorker()
    worker.worker.start_progress_thread(polling_mode=True)
    worker.progressing = True
    return worker


def release_worker(worker: UCXWorker) -> None:
    """Close `worker`'s endpoints and listener and keep it, idle (no progress thread), for
    the next `acquire_worker`."""
    worker.close()
    with _idle_lock:
        _idle.append(worker)
