"""Trainer side of the IPC backend: owns the staging buffers, packs, signals each bucket."""

from __future__ import annotations

import logging
import os
import secrets
import threading
from typing import Any

import torch

from wtransfer.errors import ConfigError
from wtransfer.manifest import Manifest
from wtransfer.packing import Bucket
from wtransfer.protocol import FleetClient, WeightSyncClient
from wtransfer.records import new_sender_id, receiver_init_dict
from wtransfer.trainer.engine import Outgoing, Share, TrainerTransferEngine
from wtransfer.trainer.layouts import LocalShards, held_parts
from wtransfer.trainer.m2n_choice import m2n_wanted, may_slice_per_worker
from wtransfer.trainer.plans import sized, staging_device
from wtransfer.trainer.source import WeightSource
from wtransfer.transport.m2n import (
    PairBucket,
    Planner,
    TransferPlan,
    fragment_with_layouts,
    pieces_to_wire,
    planner_of,
)
from wtransfer.transport.window import CallChannel
from wtransfer_ipc import m2n, m2n_in_place
from wtransfer_ipc.cuda import await_event, export_buffer, exported_event, withdraw_event
from wtransfer_ipc.info import (
    CAPABILITIES,
    CUDA_BUCKET_BYTES,
    CUDA_NUM_BUFFERS,
    STAGING_FIELDS,
    IPCTrainerInitInfo,
)
from wtransfer_ipc.sender_process import own_start_time
from wtransfer_ipc.shm import SharedBuffer
from wtransfer_ipc.zero_copy import ZeroCopyExports, shareable

_MIB = 1 << 20
log = logging.getLogger("wtransfer.ipc")


class IPCSender(TrainerTransferEngine[IPCTrainerInitInfo]):
    """Packs buckets into shared staging buffers; each `update_weights` call hands one over.

    With `num_buffers` >= 2, packing bucket k+1 overlaps the receiver unpacking bucket k.
    """

    backend_name = "ipc"
    capabilities = CAPABILITIES
    init_info_cls = IPCTrainerInitInfo

    def __init__(self, init_info: IPCTrainerInitInfo, *, client: WeightSyncClient | None,
                 source: WeightSource, process_group: Any = None) -> None:
        self._pinned_host: bool | None = None
        """Whether the source is a lone sender's pinned host tensors (see `_staging_device`;
        found once, when the base constructor first asks)."""
        self._asked = (init_info.bucket_bytes, init_info.num_buffers)
        super().__init__(init_info, client=client, source=source, process_group=process_group)
        self.device = self._staging_device(self.init_info.device)
        if self.device.type not in ("cpu", "cuda"):
            raise ConfigError(f"ipc: staging on {self.device.type} devices is not supported; "
                              "use device='cpu' or 'cuda:N'")
        self._staging: list[torch.Tensor] = []
        self._shm: list[SharedBuffer] = []
        self._packed: list[tuple[torch.cuda.Event, bytes]] = []
        """CUDA staging: one interprocess event per slot (and its IPC handle), recorded once
        the slot is packed (the receivers' streams wait on it; no host synchronization per
        bucket)."""
        self._freed: list[list[tuple[torch.cuda.Event, bytes]]] = []
        """CUDA staging of one sender: per receiving worker, one interprocess event per slot
        that the worker records after reading it; packing into a slot waits on them (on the
        GPU, not the host)."""
        self._freed_lock = threading.Lock()
        self._zero_copy: ZeroCopyExports | None = None
        """The source's exported storages, when zero-copy updates apply (CUDA, no checksums,
        one unsharded sender)."""
        self._planner: Planner | None = None
        self._in_place: ZeroCopyExports | None = None
        """M->N on CUDA: this rank's exported shards, which the workers read in place
        (`wtransfer_ipc.m2n_in_place`; zero_copy on, no checksums)."""
        self._in_place_planner: Planner | None = None
        self._in_place_pieces: tuple[TransferPlan, list[list[Any]] | None,
                                     dict[str, Any]] | None = None
        """The last in-place plan, each rank's pieces of it in wire form (None: a box is not
        contiguous in its rank's shard) and this rank's stats fields, worked out once per
        plan."""
        self.last_update_read = False
        """Whether the last update was read out of the source's own memory (zero-copy, or
        M->N in place) rather than staged."""
        self._last_moved: dict[str, Any] = {}

    def _default_staging(self, bucket_bytes: int | None) -> tuple[int, int]:
        """Packed updates of one trainer process through CUDA staging: buckets of
        `CUDA_BUCKET_BYTES`, or the source's size rounded up to a MiB where that is less (each
        bucket's hand-over costs a fixed time however small it is), and `CUDA_NUM_BUFFERS`
        buffers, or as many as the update has buckets where that is fewer. The general
        defaults for shared memory, for a sender whose updates go zero-copy (its tensors are
        contiguous CUDA tensors: it packs nothing), and for trainer ranks sending together
        (each would hold up to a bucket of gathered rows besides its staging, on a GPU the
        training fills)."""
        if not self._packs_through_cuda():
            return super()._default_staging(bucket_bytes)
        size = self._source_bytes()
        default = min(CUDA_BUCKET_BYTES, max(1, -(-size // _MIB)) * _MIB)
        buckets = -(-size // (bucket_bytes or default))
        return default, max(1, min(CUDA_NUM_BUFFERS, buckets))

    def _packs_through_cuda(self) -> bool:
        """Whether this sender's updates are packed through CUDA staging by one process (not
        zero-copy, not several trainer ranks: see `_default_staging`)."""
        held = self.source.held()
        zero_copy = self._zero_copy_on() and held is not None and shareable(held)
        return (self._staging_device(self.init_info.device).type == "cuda" and not zero_copy
                and not self.collective)

    def _staging_device(self, override: str | None) -> torch.device:
        """The init info's `device` when given; a lone sender of pinned host tensors to one
        receiving worker, in a process that uses CUDA, stages on its current GPU (one
        host-to-device copy per byte at the link's speed, where shared memory adds a CPU
        copy: 4.8x faster at 8B on an H100, docs/benchmarks.md); else the source's device.
        (Several workers keep shared memory, each reading only what it keeps: 1->N.)"""
        if not override and self._pinned_host_source():
            return torch.device("cuda", torch.cuda.current_device())
        return staging_device(override, self.source)

    def connect(self) -> None:
        """Connect (see the base); where CUDA staging was chosen for pinned host tensors by
        default and the receivers could not take it (an engine that does not see this GPU,
        or has no CUDA), connect again through shared memory, with a warning."""
        try:
            super().connect()
        except Exception as exc:
            if not self._pinned_host or self.init_info.device or self.connected:
                raise
            log.warning("ipc: the receivers could not map CUDA staging on %s (%s); staging "
                        "through shared memory instead (device='cpu' asks for it)",
                        self.device, exc)
            self._close()
            self._pinned_host = False
            self.device = torch.device("cpu")
            self.init_info = sized(self.init_info, *self._asked, self._default_staging)
            self.sender_id = new_sender_id()
            try:
                super().connect()
            except Exception as again:
                raise again from exc

    def _pinned_host_source(self) -> bool:
        if self._pinned_host is None:
            client = self.client
            # pinned memory implies CUDA is in use here: never start CUDA to find out
            held = (self.source.held() if client is not None
                    and not (self.collective or self.init_info.m2n
                             or isinstance(client, FleetClient)) and _cuda_in_use() else None)
            self._pinned_host = bool(held) and all(
                t.device.type == "cpu" and (t.is_pinned() or not t.numel())  # (empty: never)
                for t in held or ()
            ) and client is not None and client.num_workers() == 1
        return self._pinned_host

    def _source_bytes(self) -> int:
        return sum(meta.nbytes for meta in self.source.metadata())

    def _zero_copy_on(self) -> bool:
        """Whether updates go zero-copy where the tensors allow (see `zero_copy`)."""
        info = self.init_info
        return (info.zero_copy and not info.checksum and not self.source.sharded
                and not self.m2n)

    def _backend_stats(self) -> dict[str, Any]:
        return self._last_moved

    def _connect(self) -> dict[str, Any]:
        info = self.init_info
        self.m2n = (m2n_wanted(self.ranks, self.source, True) if info.m2n
                    else self._m2n_by_default() if info.m2n is None else False)
        token = secrets.token_hex(8)
        if self.device.type == "cuda":
            if self._zero_copy_on():
                self._zero_copy = ZeroCopyExports(f"{token}-read")
                self.source.read_in_place()
            if self.m2n and info.zero_copy and not info.checksum:
                self._in_place = ZeroCopyExports(f"{token}-read")
                self.source.read_in_place()
            self._staging = [torch.empty(self.bucket_bytes, dtype=torch.uint8,
                                         device=self.device) for _ in range(self.num_buffers)]
            buffers: list[Any] = [export_buffer(b, token, i) for i, b in enumerate(self._staging)]
            self._packed = [exported_event(self.device) for _ in self._staging]
            transport = "cuda"
        else:
            self._shm = SharedBuffer.create_set(self.num_buffers, self.bucket_bytes)
            self._staging = [b.tensor for b in self._shm if b.tensor is not None]
            buffers = [b.name for b in self._shm]
            transport = "shm"
        # packed host staging is reached by update calls alone (a fleet that lost an instance
        # goes on without connecting again); CUDA staging keeps events per worker, M->N a plan
        self.fixed_receivers = bool(self._packed) or self.m2n
        fragment = receiver_init_dict(info, transport=transport, buffers=buffers,
                                      sender_pid=os.getpid(), sender_start=own_start_time(),
                                      token=token, m2n=self.m2n)
        if self.m2n:
            return fragment_with_layouts(fragment,
                                         self.source.layouts(self.ranks.sender_index or 0))
        return fragment

    def _m2n_by_default(self) -> bool:
        """The default (`IPCTrainerInitInfo.m2n` None): sharded ranks that each hold a client
        send their own shards (nothing gathered): through shared memory they stage them
        (measured in docs/sharded-trainers.md), on CUDA every worker reads them in place
        (zero_copy on, no checksums; 0.048 s against 0.096 s staged for an 8B 2 -> TP=2 on
        an H100, bit-exact). Through shared memory one sender into one engine of several
        workers also sends each worker only the parts it keeps (1->N; on CUDA zero-copy
        already does). Not for deltas or adapters (their M->N forms are the pair buckets of
        nccl and ucx), nor a fleet (packed host staging lets a fleet that dropped an
        instance go on without connecting again; an M->N plan fixes its receivers)."""
        info = self.init_info
        if (isinstance(self.client, FleetClient) or info.delta
                or not self.source.delta_ok):
            return False
        sharded = m2n_wanted(self.ranks, self.source, None)
        if self.device.type != "cpu":
            return info.zero_copy and not info.checksum and sharded
        return sharded or may_slice_per_worker(self.collective, self.source, self.updates,
                                               self.client)

    def _init_receivers(self, receiver_init: dict[str, Any]) -> None:
        """CUDA staging of one sender: each engine gets one event per slot for each of its
        workers to record once it read the slot (`IPCInitInfo.free_events`)."""
        if not (self._packed and self.senders == 1 and self.client is not None):
            super()._init_receivers(receiver_init)
            return
        self.client.init_each_engine(
            lambda _first, workers: {**receiver_init, "free_events": self._free_events(workers)})

    def _free_events(self, workers: int) -> list[list[bytes]]:
        """New slot events for an engine of `workers` workers (engines init concurrently)."""
        made = [[exported_event(self.device) for _ in self._staging] for _ in range(workers)]
        with self._freed_lock:
            self._freed.extend(made)
        return [[handle for _, handle in worker] for worker in made]

    def _after_init(self) -> None:
        for buf in self._shm:  # every receiver has mapped them: drop the names, keep the memory
            buf.unlink()

    def _merge(self, fragments: list[dict[str, Any]]) -> dict[str, Any]:
        """Several senders: one init info listing every sender's staging buffers (M->N: and
        the plan between what each holds, kept here)."""
        if self.m2n:
            self._planner, fragments = planner_of(fragments, None, self.bucket_bytes)
            if all(f["transport"] == "cuda" for f in fragments):  # (alike on every rank)
                self._in_place_planner = m2n_in_place.in_place_planner(self._planner)
        first = fragments[0]
        if len(fragments) == 1:
            return first
        return {**first, "senders": [{k: f[k] for k in STAGING_FIELDS} for f in fragments]}

    def _announce(self, manifest: Manifest) -> dict[str, Any]:
        """Several senders: the tensor list travels alone, before any sender's bucket."""
        return {"tensors": manifest.wire}

    def _outgoing(self, share: Share) -> Outgoing:
        """Zero-copy where it applies (one call: the receivers copy out of the source's own
        storage), else one call per packed bucket, its staging slot reused once answered
        (M->N: see `_outgoing_m2n`)."""
        self.last_update_read = False
        if self._planner is not None:
            return self._outgoing_m2n(share, self._planner)
        if self._zero_copy is not None:
            tensors, share = share.in_place(shareable)
            if tensors is not None:
                self.last_update_read = True
                return Outgoing(share, kept=self._zero_copy, opening={
                    **share.listed_tensors(),
                    "zero_copy": self._zero_copy.update(tensors)})
        listed = share.manifest.wire
        if share.count == 1:  # (the first bucket's call carries it)
            share.listing.sent(share.manifest)

        def stage(bucket: Bucket, slot: int) -> torch.Tensor:
            self._wait_read(slot)
            share.packer.pack(bucket, self._staging[slot])
            if self._packed:  # the receivers' streams wait on this before reading the slot
                self._packed[slot][0].record(torch.cuda.current_stream(self.device))
            return self._staging[slot][: bucket.nbytes]

        def describe(bucket: Bucket, slot: int, _data: torch.Tensor,
                     checksum: int | None) -> dict[str, Any]:
            update: dict[str, Any] = {
                "buffer": slot, "nbytes": bucket.nbytes, "checksum": checksum,
                "slices": [s.to_wire() for s in bucket.slices],
            }
            if self._packed:
                update["event"] = self._packed[slot][1]
            if share.count > 1:
                update["sender"] = share.index
            elif bucket.index == 0:
                update["tensors"] = listed
            return update

        return Outgoing(share, channel=CallChannel(slots=len(self._staging), stage=stage,
                                                   describe=describe))

    def _outgoing_m2n(self, share: Share, planner: Planner) -> Outgoing:
        """This rank's buckets of the plan, each packed from its own shards into a free
        staging slot and handed to every worker, which copies what it keeps
        (`wtransfer_ipc.m2n`)."""
        metas = share.manifest.metas
        me = share.index
        shards: LocalShards | None = None
        failure: BaseException | None = None
        try:
            shards = LocalShards(metas, share.parts if share.parts is not None
                                 else held_parts(self.source, metas), me)
        except Exception as exc:  # raised once every rank took part in the gather below
            failure = exc
        read = self._outgoing_in_place(share, shards)
        if failure is not None:
            raise failure
        assert shards is not None
        if read is not None:
            return read
        plan = planner.plan(share.manifest)
        mine = tuple(plan.of_sender(me))
        self._last_moved = {"buckets": len(mine), "sent_bytes": plan.bytes_from(me)}

        def stage(bucket: PairBucket, slot: int) -> torch.Tensor:
            self._wait_read(slot)
            data = shards.pack(bucket, metas, self._staging[slot])
            if self._packed:
                self._packed[slot][0].record(torch.cuda.current_stream(self.device))
            return data

        def describe(bucket: PairBucket, slot: int, _data: torch.Tensor,
                     checksum: int | None) -> dict[str, Any]:
            update = m2n.describe(bucket, slot, me, checksum)
            if self._packed:
                update["event"] = self._packed[slot][1]
            return update

        opening = None
        if share.lead and share.count == 1:  # (several senders: the list was announced before
            share.listing.sent(share.manifest)  # any bucket; only a zero-copy update may
            opening = {"tensors": share.manifest.wire}  # name it by digest)
        return Outgoing(share, opening=opening, units=mine,
                        channel=CallChannel(slots=len(self._staging), stage=stage,
                                            describe=describe))

    def _outgoing_in_place(self, share: Share, shards: LocalShards | None) -> Outgoing | None:
        """M->N read in place (`wtransfer_ipc.m2n_in_place`): every rank's record gathered
        (on every rank of an M->N transfer, whatever it holds: no rank is left waiting), the
        lead's one call carrying them all; None (on every rank alike) where some rank cannot
        share its shards (`shards` None: it failed to read them), holds other boxes than
        it published, or a piece is not contiguous in them: staged instead."""
        exports, planner = self._in_place, self._in_place_planner
        if planner is None:  # (set alike on every rank: M->N, every rank staging on CUDA)
            return None
        record = None
        if exports is not None and shards is not None:
            if shards.layouts == planner.sources[share.index]:
                record = m2n_in_place.rank_record(exports, shards.locals)
            else:
                log.warning("M->N in place: this rank holds other boxes than it published "
                            "at connect; this update goes through staging")
        records = self.ranks.gather(record)
        if exports is None or any(r is None for r in records):
            return None
        plan = planner.plan(share.manifest)
        if self._in_place_pieces is None or self._in_place_pieces[0] is not plan:
            found = m2n_in_place.pieces_by_rank(plan, planner.sources, share.manifest.metas)
            self._in_place_pieces = (
                plan, None if found is None else [pieces_to_wire(mine) for mine in found],
                {"buckets": len(plan.of_sender(share.index)),
                 "sent_bytes": plan.bytes_from(share.index)})
        _, pieces, moved = self._in_place_pieces
        if pieces is None:
            log.warning("M->N in place: a planned box is not contiguous in its rank's shard; "
                        "this update goes through staging")
            return None
        self.last_update_read = True
        self._last_moved = moved
        opening = None
        if share.lead:  # (the whole update, its tensor list too: nothing is announced)
            opening = {**share.listed_tensors(),
                       "in_place_ranks": [{"zero_copy": record, "pieces": mine}
                                          for record, mine in zip(records, pieces, strict=True)]}
        return Outgoing(share, opening=opening, kept=exports, lead_only=True)

    def _failed(self, exc: BaseException) -> None:
        """An update failed on some rank: send every shard's handle again next time (this
        rank confirmed them without a call of its own)."""
        if self._in_place is not None:
            self._in_place.forget()

    def _wait_read(self, slot: int) -> None:
        """Pack into staging `slot` only once every worker's reads of its last bucket ran (the
        workers answered once those reads were queued, not done). Polled on the host with
        the transfer's deadline rather than waited for on the trainer's stream: an engine
        that died with its reads queued must not stall the trainer's GPU work forever."""
        for worker in self._freed:
            await_event(worker[slot][0], self.init_info.timeout_s,
                        "an engine's reads of a staging buffer", "is the engine alive?")

    def _close(self) -> None:
        had_cuda = bool(self._staging) and self.device.type == "cuda"
        self._staging = []
        for _, handle in self._packed + [e for worker in self._freed for e in worker]:
            withdraw_event(handle)
        self._packed = []
        self._freed = []
        for exports in (self._zero_copy, self._in_place):
            if exports is not None:
                exports.close()
        self._zero_copy = self._in_place = None
        for buf in self._shm:
            buf.close()
        self._shm = []
        if had_cuda:
            torch.cuda.ipc_collect()


def _cuda_in_use() -> bool:
    """Whether this process already uses CUDA (a context on some device), found without
    making a context (the device count may load the driver): a bare `pin_memory()` makes
    one while torch's Python side still says CUDA is not initialized."""
    if torch.cuda.is_initialized():
        return True
    has_context = getattr(torch._C, "_cuda_hasPrimaryContext", None)  # (CUDA builds)
    return has_context is not None and any(has_context(index)
                                           for index in range(torch.cuda.device_count()))
