"""Broadcast groups that need no default process group: gloo for CPU, NCCL for CUDA.

Both sides rendezvous through a `TCPStore` hosted by the first sender at
``master_address:master_port`` (port 0: one the OS picks), under a per-init session prefix.
Every wait has a deadline:
`Pending.wait` polls the operation, the peer-failure check the caller gives, and the clock,
and a group that failed or timed out is torn down (`abort`) rather than reused.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from wtransfer.errors import ConfigError, PeerError, TransferTimeout
from wtransfer_nccl.libnccl import load_nccl

MAX_INFLIGHT = 16
"""Units (`wtransfer.transport.window.units`) posted ahead per side: staging slots bound the packed
ones; direct ones (into the parameter itself) need none, and keeping several in flight hides
each call's latency."""
DIRECT_BATCH = 32
"""Consecutive direct tensors one NCCL group call launches together (the sender's choice; it
travels in the init info so every rank groups alike). Two H200s over NVLink, Qwen3-8B shapes,
raw NCCL: one broadcast per tensor 49.5 ms, 8 per group 45.3, 32 per group 44.6, one broadcast
of every byte 44.1 (2026-11-29)."""

DIRECT_FIRST = 2
"""Direct tensors in the first group call of an update: the receiver prepares (and the bytes
start moving after) two destinations instead of 32; the next groups are posted while it moves."""


def host_rendezvous(address: str, port: int, timeout_s: float) -> dist.TCPStore:
    """The rendezvous server, hosted by the first sender. Port 0 lets the OS pick a free one
    (read it back from `.port`), so no other process can take it between choosing and binding."""
    try:
        return dist.TCPStore(address, port, None, True, timedelta(seconds=timeout_s),
                             wait_for_workers=False)
    except (RuntimeError, OSError) as exc:
        raise ConfigError(f"the trainer could not host the rendezvous at {address}:{port}: "
                          f"{exc}; use a free master_port, or master_port=0 to let the OS "
                          "choose one") from None


def join_rendezvous(address: str, port: int, rank: int, session: str,
                    timeout_s: float) -> dist.Store:
    """Connect rank `rank` to the session's rendezvous before the deadline."""
    try:
        store = dist.TCPStore(address, port, None, False, timedelta(seconds=timeout_s))
    except (RuntimeError, OSError) as exc:
        raise TransferTimeout(f"rank {rank} could not reach the rendezvous at {address}:{port} "
                              f"within {timeout_s:g}s: {exc}") from None
    return session_store(store, session)


def session_store(store: dist.Store, session: str) -> dist.Store:
    """The keys of one init (`session`) in a rendezvous store."""
    return dist.PrefixStore(f"wtransfer/{session}/", store)


def sender_store(store: dist.Store, sender: int, senders: int) -> dist.Store:
    """The keys of sender `sender`'s group (the session's own store when it is the only one)."""
    return store if senders == 1 else dist.PrefixStore(f"sender{sender}/", store)


class Pending(ABC):
    """An operation in flight."""

    poll_s: float = 0.0005
    """How often `wait` looks again: the latency between completion and the host noticing
    (CUDA lowers it: at the last broadcast of an update it adds straight to the transfer)."""

    @abstractmethod
    def done(self) -> bool:
        """True once finished (raises `PeerError` if it failed)."""

    def wait(self, timeout_s: float, check: Callable[[], None] | None = None) -> None:
        """Wait for completion; `check()` may raise to stop early (a peer reported failure)."""
        deadline = time.monotonic() + timeout_s
        while not self.done():
            if check is not None:
                check()
            if time.monotonic() > deadline:
                raise TransferTimeout(f"a transfer did not complete within {timeout_s:g}s: a "
                                      "peer is gone or stalled")
            time.sleep(self.poll_s)


class Group(ABC):
    """A group of `world_size` ranks: broadcasts rooted at rank 0, and point-to-point
    messages (M->N transfers)."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size

    @abstractmethod
    def broadcast(self, tensors: Sequence[torch.Tensor]) -> Pending:
        """Start in-place broadcasts of the flat uint8 `tensors` from rank 0, as one operation
        (one unit of the posting window)."""

    @abstractmethod
    def send(self, tensor: torch.Tensor, peer: int) -> Pending:
        """Start sending flat uint8 `tensor` to rank `peer` (messages between two ranks
        arrive in the order they were sent)."""

    @abstractmethod
    def recv(self, tensor: torch.Tensor, peer: int) -> Pending:
        """Start receiving the next message from rank `peer` into flat uint8 `tensor`."""

    @abstractmethod
    def abort(self) -> None:
        """Tear the group down without waiting for peers (after a failure or timeout)."""

    @abstractmethod
    def close(self) -> None:
        """Release a healthy group."""


class _GlooPending(Pending):
    """A gloo operation: a collective reports completion through its future; a send or
    receive has none (`p2p`), so a daemon thread waits on it (within the group's own timeout)
    and reports."""

    def __init__(self, work: dist.Work, p2p: bool = False) -> None:
        self._work = work
        self._p2p = p2p
        self._event = threading.Event()
        self._error: str | None = None
        if p2p:
            threading.Thread(target=self._await, name="wtransfer-gloo-p2p", daemon=True).start()
        else:
            work.get_future().add_done_callback(lambda _: self._event.set())

    def _await(self) -> None:
        try:
            self._work.wait()
        except RuntimeError as exc:
            self._error = str(exc)
        self._event.set()

    def done(self) -> bool:
        if not self._event.is_set():
            return False
        try:
            if self._error is None and not self._p2p:  # a send or receive is waited once
                self._work.wait()  # (a second wait would wait for another message)
        except RuntimeError as exc:
            self._error = str(exc)
        if self._error is not None:
            raise PeerError(f"gloo transfer failed (a peer died or left): {self._error}")
        return True

    def wait(self, timeout_s: float, check: Callable[[], None] | None = None) -> None:
        deadline = time.monotonic() + timeout_s
        while not self._event.wait(min(0.05, max(0.0, deadline - time.monotonic()))):
            if check is not None:
                check()
            if time.monotonic() > deadline:
                raise TransferTimeout(f"a transfer did not complete within {timeout_s:g}s: a "
                                      "peer is gone or stalled")
        self.done()


class _AllPending(Pending):
    def __init__(self, parts: list[Pending]) -> None:
        self._parts = parts

    def done(self) -> bool:
        return all(part.done() for part in self._parts)

    def wait(self, timeout_s: float, check: Callable[[], None] | None = None) -> None:
        deadline = time.monotonic() + timeout_s
        for part in self._parts:
            part.wait(max(0.0, deadline - time.monotonic()), check)


class GlooGroup(Group):
    """CPU tensors over gloo (TCP)."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, timeout_s: float) -> None:
        super().__init__(rank, world_size)
        try:
            self._pg: dist.ProcessGroupGloo | None = dist.ProcessGroupGloo(
                store, rank, world_size, timedelta(seconds=timeout_s))
        except RuntimeError as exc:
            raise TransferTimeout(f"gloo group of {world_size} ranks did not form within "
                                  f"{timeout_s:g}s (rank {rank}): {exc}") from None

    def broadcast(self, tensors: Sequence[torch.Tensor]) -> Pending:
        """Start one gloo broadcast per tensor."""
        if self._pg is None:
            raise PeerError("the group was torn down after a failure")
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        pg: Any = self._pg
        parts: list[Pending] = [_GlooPending(pg.broadcast([t], opts)) for t in tensors]
        return parts[0] if len(parts) == 1 else _AllPending(parts)

    def send(self, tensor: torch.Tensor, peer: int) -> Pending:
        """Start a gloo send."""
        return _GlooPending(self._live().send([tensor], peer, 0), p2p=True)

    def recv(self, tensor: torch.Tensor, peer: int) -> Pending:
        """Start a gloo receive."""
        return _GlooPending(self._live().recv([tensor], peer, 0), p2p=True)

    def _live(self) -> Any:
        if self._pg is None:
            raise PeerError("the group was torn down after a failure")
        return self._pg

    def abort(self) -> None:
        """Drop the group; gloo's threads finish on their own timeouts, off this thread."""
        holder, self._pg = [self._pg], None
        threading.Thread(target=holder.clear, name="wtransfer-gloo-teardown", daemon=True).start()

    def close(self) -> None:
        """Drop the group."""
        self._pg = None


class _NCCLPending(Pending):
    poll_s = 0.00005  # an event query costs a few microseconds

    def __init__(self, group: NCCLGroup, event: torch.cuda.Event,
                 tensors: Sequence[torch.Tensor]) -> None:
        self._group = group
        self._event = event
        self._tensors = tensors
        """Held until the broadcast is waited on, so no buffer it reads or writes is freed
        (and reused by the allocator) before the group's stream is done with it."""

    def done(self) -> bool:
        self._group.raise_async_error()
        return bool(self._event.query())


class NCCLGroup(Group):
    """CUDA tensors through the NCCL library, on a dedicated stream of `device`."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, timeout_s: float,
                 device: torch.device) -> None:
        super().__init__(rank, world_size)
        self.lib = load_nccl()
        self.device = device
        if rank == 0:
            store.set("nccl_uid", self.lib.unique_id())  # type: ignore[arg-type]
        try:
            store.wait(["nccl_uid"], timedelta(seconds=timeout_s))
        except RuntimeError as exc:
            raise TransferTimeout(f"rank {rank}: no NCCL id from rank 0 within "
                                  f"{timeout_s:g}s: {exc}") from None
        uid = bytes(store.get("nccl_uid"))
        self.stream = torch.cuda.Stream(device)
        result: dict[str, Any] = {}

        def init() -> None:
            try:
                with torch.cuda.device(device):
                    result["comm"] = self.lib.init_rank(world_size, uid, rank)
                    self._connect(result["comm"])
                    result["ready"] = True
            except BaseException as exc:
                result["error"] = exc

        thread = threading.Thread(target=init, name="wtransfer-nccl-init", daemon=True)
        thread.start()
        thread.join(timeout_s)
        if "ready" not in result:
            if result.get("comm"):
                self.lib.abort(result["comm"])
            if "error" in result:
                raise result["error"]
            raise TransferTimeout(f"NCCL communicator of {world_size} ranks did not form and "
                                  f"connect within {timeout_s:g}s (rank {rank})")
        self._comm: int | None = int(result["comm"])

    def _connect(self, comm: int) -> None:
        """One 1-byte broadcast right after init, on every rank. NCCL connects its rings at
        a communicator's first collective, and that connect blocks the calling host thread
        until every peer calls one too, with no deadline of its own: a receiver that refused
        an update before its first broadcast left the trainer stuck inside `ncclBroadcast`
        for good (H200 pair, 2026-11-29). Here it happens under the init deadline instead."""
        probe = torch.zeros(1, dtype=torch.uint8, device=self.device)
        self.lib.broadcast(comm, probe.data_ptr(), 1, 0, self.stream.cuda_stream)
        self.stream.synchronize()

    def raise_async_error(self) -> None:
        """Raise `PeerError` (and abort) if NCCL reported an asynchronous failure."""
        if self._comm is None:
            raise PeerError("the NCCL communicator was torn down after a failure")
        code = self.lib.async_error(self._comm)
        if code not in (0, 7):
            self.abort()
            raise PeerError(f"NCCL failed: {self.lib.error_string(code)} (a peer died or left)")

    def broadcast(self, tensors: Sequence[torch.Tensor]) -> Pending:
        """Enqueue the broadcasts on the group's stream after the current stream's work; more
        than one go in one NCCL group call, launched as one kernel (`DIRECT_BATCH`)."""
        if isinstance(tensors, torch.Tensor):
            raise TypeError("broadcast takes a list of flat uint8 tensors, not one tensor")
        comm = self._comm
        if comm is None:
            raise PeerError("the NCCL communicator was torn down after a failure")
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        stream = self.stream.cuda_stream
        grouped = len(tensors) > 1
        if grouped:
            self.lib.group_start()
        try:
            for tensor in tensors:
                if tensor.numel():
                    self.lib.broadcast(comm, tensor.data_ptr(), tensor.numel(), 0, stream)
        finally:
            if grouped:
                self.lib.group_end()
        event = torch.cuda.Event()
        event.record(self.stream)
        return _NCCLPending(self, event, tensors)

    def send(self, tensor: torch.Tensor, peer: int) -> Pending:
        """Enqueue a send on the group's stream after the current stream's work."""
        return self._p2p(self.lib.send, tensor, peer)

    def recv(self, tensor: torch.Tensor, peer: int) -> Pending:
        """Enqueue a receive on the group's stream after the current stream's work."""
        return self._p2p(self.lib.recv, tensor, peer)

    def _p2p(self, op: Callable[[int, int, int, int, int], None], tensor: torch.Tensor,
             peer: int) -> Pending:
        comm = self._comm
        if comm is None:
            raise PeerError("the NCCL communicator was torn down after a failure")
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        if tensor.numel():
            op(comm, tensor.data_ptr(), tensor.numel(), peer, self.stream.cuda_stream)
        event = torch.cuda.Event()
        event.record(self.stream)
        return _NCCLPending(self, event, [tensor])

    def abort(self) -> None:
        """Abort the communicator: every rank's pending NCCL work errors out."""
        comm, self._comm = self._comm, None
        if comm:
            self.lib.abort(comm)

    def close(self) -> None:
        """Release a healthy communicator once this rank's work on it is done.

        `ncclCommDestroy` finalizes with the peers and so blocks until every rank destroys
        its communicator too (a sender shut down while receivers kept theirs waited about
        100 s); `ncclCommAbort` frees this rank's resources at once, and each receiver
        releases its own when its next sender initializes it, or when it shuts down."""
        comm, self._comm = self._comm, None
        if comm:
            self.stream.synchronize()
            self.lib.abort(comm)


def make_group(transport: str, store: dist.Store, rank: int, world_size: int,
               timeout_s: float, device: torch.device) -> Group:
    """Create the group for `transport` ("gloo" or "nccl")."""
    if transport == "nccl":
        return NCCLGroup(store, rank, world_size, timeout_s, device)
    return GlooGroup(store, rank, world_size, timeout_s)
