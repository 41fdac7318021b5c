"""Engine side of the IPC backend: maps the sender's staging buffers once, unpacks buckets."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from typing import Any

import torch

from wtransfer.errors import ConfigError, MetadataError, PeerError
from wtransfer.manifest import Manifest
from wtransfer.packing import Slice, TensorMeta
from wtransfer.protocol import spin_start
from wtransfer.receiver.engine import ReceiverState, WeightTransferEngine
from wtransfer.receiver.session import UpdateSession
from wtransfer.receiver.target import WeightTarget
from wtransfer.transport.m2n import pieces_from_wire
from wtransfer_ipc.cuda import SenderEvents, await_event, drain, open_buffer
from wtransfer_ipc.info import (
    CAPABILITIES,
    IPCInitInfo,
    IPCUpdateInfo,
    RankInPlace,
    ZeroCopyUpdate,
)
from wtransfer_ipc.m2n_in_place import RanksInPlace
from wtransfer_ipc.sender_process import ProcessWatch
from wtransfer_ipc.shm import SharedBuffer, creator_alive, sweep
from wtransfer_ipc.zero_copy import ZeroCopyImports

log = logging.getLogger("wtransfer.ipc.receiver")

RELEASE_CHECK_S = 1.0
"""How often a worker that maps a trainer's memory looks whether that process is gone."""


class IPCReceiver(WeightTransferEngine[IPCInitInfo, IPCUpdateInfo]):
    """Receives through shared staging memory; each update call consumes one bucket."""

    backend_name = "ipc"
    init_info_cls = IPCInitInfo
    update_info_cls = IPCUpdateInfo
    capabilities = CAPABILITIES

    def __init__(self, target: WeightTarget, **options: Any) -> None:
        super().__init__(target, **options)
        self._shm: list[SharedBuffer] = []
        self._staging: list[list[torch.Tensor]] = []
        """Each sender's mapped staging buffers."""
        self._events = SenderEvents()
        self._free: list[bytes] | None = None
        """The trainer's per-buffer events this worker records after reading (see
        `IPCInitInfo.free_events`); None: it waits for its reads before answering."""
        self._unfinished: torch.device | None = None
        """The device whose stream holds reads not yet waited for (at finish)."""
        self._zero_copy = ZeroCopyImports()
        self._ranks_in_place = RanksInPlace()
        self._last_copies_s = 0.0
        """How long the last zero-copy update's copies took, issued to done (the next one
        waits for its copies' end without sleeping from shortly before: `spin_start`)."""
        self._trainer: ProcessWatch | None = None
        self._stop_watch = threading.Event()
        """Set to end the thread watching the current sender's process (`_release_when_gone`)."""
        self._released: str | None = None
        """Why this worker unmapped its sender's memory (the trainer's process is gone); its
        later update calls are refused saying so, until a new sender's init."""
        self._read_stream: torch.cuda.Stream | None = None
        """The CUDA stream the last update queued its reads of the trainer's memory on (they
        end before that memory is unmapped)."""

    def _init(self, info: IPCInitInfo) -> None:
        self._events.close()  # a new sender records new events
        self._released = None
        self._unfinished = None
        self._trainer = watch = ProcessWatch(info.sender_pid, info.sender_start)
        try:
            self._free = info.free_events_of(self.worker_index)
            self._staging = [self._open(info, staging) for staging in info.stagings()]
        except BaseException:
            self._shutdown()  # unmap what was mapped before the failure
            raise
        if watch.active and info.sender_pid != os.getpid():
            self._stop_watch.set()  # (the last sender's watcher, if any)
            self._stop_watch = stop = threading.Event()
            threading.Thread(target=self._release_when_gone, args=(watch, stop), daemon=True,
                             name="wtransfer-ipc-release").start()

    def _release_when_gone(self, watch: ProcessWatch, stop: threading.Event) -> None:
        """Unmap everything of the trainer's once its (lead) process is gone and no update is
        open: the mappings of its staging, its tensors (zero-copy) and its ranks' shards (M->N
        in place) keep that memory allocated (on a GPU: a trainer restarted there could not
        allocate its model before its init reached this worker). Ends with the sender it
        watches (a new init, or shutdown: `stop`)."""
        while not stop.wait(RELEASE_CHECK_S):
            with self._lock:
                if self._trainer is not watch:
                    return
                if self.state is ReceiverState.UPDATING or not watch.gone():
                    continue
                log.info("ipc: the trainer process (pid %d) is gone; unmapping its memory",
                         watch.pid)
                stream = self._read_stream
                if stream is not None:  # reads a failed update queued end first
                    with contextlib.suppress(Exception):
                        done = torch.cuda.Event()
                        done.record(stream)
                        await_event(done, self._timeout_s(), "reads of the trainer's memory",
                                    "its process is gone")
                self._programs.clear()  # (their views hold the storages)
                self._shutdown()
                self._trainer = watch  # (an update opened later still fails at once)
                self._released = (f"the trainer process (pid {watch.pid}) is gone and this "
                                  "worker unmapped its memory; initialize the transfer again "
                                  "(trainer_init)")
                return

    def _sender_gone(self) -> str | None:
        trainer = self._trainer
        if trainer is not None and trainer.gone():
            return f"the trainer process (pid {trainer.pid}) exited or died"
        return None

    def _open(self, info: IPCInitInfo, staging: dict[str, Any]) -> list[torch.Tensor]:
        """Map one sender's staging buffers."""
        if staging["transport"] == "shm":
            sweep()
            opened = []
            for name in staging["buffers"]:
                if not isinstance(name, str):
                    raise MetadataError("shm buffer names must be strings")
                opened.append(SharedBuffer(name, info.bucket_bytes, create=False))
                self._shm.append(opened[-1])
            for buf in opened:  # the creator died before it could drop the names
                if not creator_alive(buf.name):
                    buf.remove_name()
                if self.device.type == "cuda" and not buf.pin():
                    log.warning("ipc: could not page-lock shared-memory staging %s; copies "
                                "to %s go through pageable memory (slower)", buf.name,
                                self.device)
            return [b.tensor for b in opened if b.tensor is not None]
        same = staging["sender_pid"] == os.getpid()
        return [open_buffer(rec, token=staging["token"], index=i, same_process=same,
                            size=info.bucket_bytes)
                for i, rec in enumerate(staging["buffers"])]

    def _start(self) -> None:
        """Refuse an update of a sender whose memory this worker unmapped (`_released`)."""
        if self._released is not None:
            raise PeerError(self._released)

    def _receive(self, info: IPCUpdateInfo, session: UpdateSession) -> None:
        if self._released is not None:
            raise PeerError(self._released)
        if self.device.type == "cuda":
            self._read_stream = torch.cuda.current_stream(self.device)
        m2n = self._init_info().m2n
        if info.in_place_ranks is not None and (
                not m2n or info.pieces or info.slices or info.zero_copy is not None
                or info.event is not None):
            raise MetadataError("'in_place_ranks' is a whole M->N update on its own: this "
                                "transfer is not M->N, or the call carries a bucket too")
        manifest = self._listed(info)
        if manifest is not None:
            session.announce(manifest.metas)
            if m2n:  # only what this worker keeps arrives of each tensor
                session.keep_only(self.target.keeps())
            if info.zero_copy is not None:
                self._receive_zero_copy(info.zero_copy, manifest.metas, session)
                return
        elif info.zero_copy is not None:
            raise MetadataError("a zero-copy update must carry its tensor list (or its digest)")
        if info.in_place_ranks is not None:
            self._receive_in_place(info.in_place_ranks, session)
            return
        if info.slices and m2n:
            raise MetadataError("this transfer is M->N: its buckets carry 'pieces', not "
                                "'slices'; initialize the transfer again")
        if info.pieces and not m2n:
            raise MetadataError("'pieces' arrived in a transfer that is not M->N; initialize "
                                "the transfer again")
        if not info.slices and not info.pieces:
            return
        if not 0 <= info.sender < len(self._staging):
            raise MetadataError(f"sender index {info.sender} out of range "
                                f"[0, {len(self._staging)})")
        buffers = self._staging[info.sender]
        if not 0 <= info.buffer < len(buffers):
            raise MetadataError(f"buffer index {info.buffer} out of range "
                                f"[0, {len(buffers)})")
        staging = buffers[info.buffer]
        if info.event is not None:
            if not staging.is_cuda:
                raise MetadataError("'event' orders reads of CUDA staging; this sender's "
                                    "staging is shared memory")
            self._events.wait(info.event, staging.device)
        if info.pieces:
            pieces = pieces_from_wire(info.pieces)

            def consume() -> None:
                session.consume_pieces(staging, info.nbytes, pieces, info.checksum, crop=True)
        else:
            slices = [Slice.from_wire(s) for s in info.slices]

            def consume() -> None:
                session.consume(staging, info.nbytes, slices, info.checksum)
        if self._free is not None:  # the trainer's stream waits for these reads
            self._unfinished = staging.device
            try:
                consume()
            finally:  # even reads queued before a failure must finish before a rewrite
                self._events.record(self._free[info.buffer], staging.device)
        else:
            consume()
            if staging.is_cuda or self.device.type == "cuda":  # done reading: slot is free
                drain(staging.device if staging.is_cuda else self.device, self._timeout_s())

    def _listed(self, info: IPCUpdateInfo) -> Manifest | None:
        """The tensor list this update carries or names by digest (None: neither); only a
        zero-copy update (one call for the whole update) may name it."""
        if (info.tensors is None and info.tensors_digest is not None and info.zero_copy is None
                and info.in_place_ranks is None):
            raise MetadataError("only a zero-copy update may name its tensor list by digest")
        return self.manifests.resolve(info.tensors, info.tensors_digest)

    def _receive_zero_copy(self, update: ZeroCopyUpdate, metas: list[TensorMeta],
                           session: UpdateSession) -> None:
        """Copy every tensor straight from the sender's storage (see `zero_copy`)."""
        if self.device.type != "cuda":
            raise ConfigError("a zero-copy update shares CUDA memory: create the receiver "
                              "with device='cuda:N', or send with zero_copy=False in the "
                              "trainer's IPCTrainerInitInfo (staged)")
        started = time.monotonic()
        try:
            session.load_whole(self._zero_copy.sources(update, metas, self.device))
        except BaseException:  # copies queued before the failure still read the trainer's
            with contextlib.suppress(Exception):  # tensors: they run before the answer
                drain(self.device, self._timeout_s())
            raise
        drain(self.device, self._timeout_s(),  # done reading: the trainer may write its
              spin_start(started, self._last_copies_s))  # weights again once this returns
        self._last_copies_s = time.monotonic() - started

    def _receive_in_place(self, records: list[RankInPlace], session: UpdateSession) -> None:
        """Copy what this worker keeps straight out of every trainer rank's shards (see
        `m2n_in_place`), answering once the copies ran."""
        if self.device.type != "cuda":
            raise ConfigError("an M->N update read in place shares CUDA memory: create the "
                              "receiver with device='cuda:N', or send with zero_copy=False in "
                              "the trainer's IPCTrainerInitInfo (staged)")
        manifest = self.manifests.last
        if manifest is None:
            raise MetadataError("an M->N update read in place came before any tensor list")
        started = time.monotonic()
        try:
            self._ranks_in_place.load(session, records, manifest.metas,
                                      len(self._init_info().stagings()), self.device)
        except BaseException:  # copies queued before the failure still read the trainers'
            with contextlib.suppress(Exception):  # shards: they run before the answer
                drain(self.device, self._timeout_s())
            raise
        drain(self.device, self._timeout_s(), spin_start(started, self._last_copies_s))
        self._last_copies_s = time.monotonic() - started

    def _finish(self) -> None:
        """Wait (within the deadline) for the reads the buckets queued: the weights are in
        when finish answers."""
        if self._unfinished is not None:
            drain(self._unfinished, self._timeout_s())
            self._unfinished = None

    def _abort(self) -> None:
        self._unfinished = None

    def _timeout_s(self) -> float:
        return self._init_info().timeout_s

    def _init_info(self) -> IPCInitInfo:
        assert self.init_info is not None  # an update runs only after init
        return self.init_info

    def _shutdown(self) -> None:
        self._trainer = None
        self._stop_watch.set()
        self._read_stream = None
        self._zero_copy.close()
        self._ranks_in_place.close()
        self._events.close()
        self._free = None
        self._staging = []
        for buf in self._shm:
            buf.close()
        self._shm = []
