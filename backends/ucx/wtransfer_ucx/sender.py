"""Trainer side of the UCX backend: listens, then sends every bucket to every worker, or
(M->N, `wtransfer_ucx.m2n`) each worker the parts of this rank's shards that it keeps."""

from __future__ import annotations

import ipaddress
import logging
import secrets
from dataclasses import dataclass
from typing import Any

import torch

from wtransfer.errors import LifecycleError
from wtransfer.packing import CHECKSUM_BYTES, Bucket
from wtransfer.protocol import FleetClient, WeightSyncClient
from wtransfer.records import receiver_init_dict
from wtransfer.trainer.deltas import PairDeltaSender
from wtransfer.trainer.engine import (
    Outgoing,
    Share,
    TrainerTransferEngine,
    resolve_direct_threshold,
)
from wtransfer.trainer.layouts import LocalShards, held_parts
from wtransfer.trainer.m2n_choice import m2n_wanted, may_slice_per_worker
from wtransfer.trainer.pairs import pair_send
from wtransfer.trainer.plans import staging_device
from wtransfer.trainer.source import WeightSource
from wtransfer.transport.m2n import Planner, fragment_with_layouts, planner_of
from wtransfer.transport.window import SendChannel
from wtransfer_ucx import m2n
from wtransfer_ucx.info import CAPABILITIES, UCXTrainerInitInfo
from wtransfer_ucx.m2n_reads import rank_table
from wtransfer_ucx.remote_reads import ExportedTensors, readable
from wtransfer_ucx.transport import (
    MAX_INFLIGHT,
    Outbox,
    UCXWorker,
    acquire_worker,
    release_worker,
    tag,
)

log = logging.getLogger("wtransfer.ucx.sender")


@dataclass(frozen=True)
class ReadsChoice:
    """Whether a sender's updates go as one-sided reads (`on`) and why (`reason`)."""

    on: bool
    reason: str

    def __str__(self) -> str:
        return self.reason


def is_loopback(address: str) -> bool:
    """Whether `address` (a listen address: a name or an IP) is this host's loopback."""
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


class UCXSender(TrainerTransferEngine[UCXTrainerInitInfo]):
    """Packs bucket k+1 while bucket k is on the wire to every worker (one endpoint each)."""

    backend_name = "ucx"
    init_info_cls = UCXTrainerInitInfo
    capabilities = CAPABILITIES

    def __init__(self, init_info: UCXTrainerInitInfo, *, client: WeightSyncClient | None,
                 source: WeightSource, process_group: Any = None) -> None:
        super().__init__(init_info, client=client, source=source, process_group=process_group)
        self.device = staging_device(self.init_info.device, self.source)
        self.direct_threshold = resolve_direct_threshold(
            self.init_info, self.source, 0 if self.device.type == "cuda" else 1 << 20)
        """Tensors this large go from the source tensor straight into the worker's parameter
        (no staging copy on either side); off with checksums and sharded sources. Default:
        1 MiB for host memory; off for CUDA memory, where each UCX message costs about
        0.15 ms of rendezvous (measured on one H200: Qwen3-1.7B shapes 45 ms as ~300 direct
        messages, 17 ms as a few packed 1 GiB buckets)."""
        self._session = secrets.randbelow(1 << 16)
        self._updates = 0
        self._broken: str | None = None
        self._ucx: UCXWorker | None = None
        self._endpoints: list[Any] = []
        self._staging: list[torch.Tensor] = []
        self._exports: ExportedTensors | None = None
        """The source's tensors registered for the workers' one-sided reads, when those
        apply (`UCXTrainerInitInfo.rma`)."""
        self.reads = ReadsChoice(False, "not connected yet")
        """Whether updates go as one-sided reads, and why (chosen at init)."""
        self.last_update_read = False
        """Whether the last update went as one-sided reads (with `reads` chosen, an update
        whose tensors cannot be read in place goes as tagged messages; a warning says why)."""
        self._planner: Planner | None = None
        self._rosters: list[Outbox] = []
        """M->N: the roster messages the workers have not all read yet (the lead's)."""
        self._last_moved: dict[str, Any] = {}

    def _choose_reads(self) -> ReadsChoice:
        """`UCXTrainerInitInfo.rma` applied to this sender (see there)."""
        info, ucx = self.init_info, self._ucx
        assert ucx is not None
        if self.m2n:
            return self._choose_m2n_reads()
        if info.checksum or self.source.sharded:
            return ReadsChoice(False, "tagged buckets: checksums and sharded sources need them")
        if info.rma is not None:
            return ReadsChoice(info.rma, f"{'one-sided reads' if info.rma else 'tagged buckets'}"
                                         f" (rma={info.rma})")
        where = self.source.device
        if where is None or where.type != "cuda":
            return ReadsChoice(False, "tagged buckets: the trainer's tensors are not all on "
                                      "CUDA (rma=None reads only GPU memory)")
        if not ucx.cuda_ipc:
            return ReadsChoice(False, "tagged buckets: this UCX has no cuda_ipc transport "
                                      "that reads GPU memory (see UCX_TLS and "
                                      "UCX_CUDA_IPC_ENABLE_GET_ZCOPY)")
        if not is_loopback(info.listen_address):
            return ReadsChoice(False, f"tagged buckets: listen_address "
                                      f"{info.listen_address!r} may take workers on other "
                                      "hosts (rma=True reads where RDMA reaches this GPU)")
        return ReadsChoice(True, "one-sided reads: CUDA tensors, cuda_ipc, every worker on "
                                 "this host (loopback listen_address)")

    def _choose_m2n_reads(self) -> ReadsChoice:
        """M->N: each worker reads its pair buckets out of every rank's shards only when asked
        (rma=True) and nothing needs the ranks to pack (checksums, deltas)."""
        info = self.init_info
        if info.rma is not True:
            return ReadsChoice(False, "tagged pair buckets: M->N (m2n) reads only with "
                                      f"rma=True (rma={info.rma})")
        if info.checksum or self.delta is not None:
            return ReadsChoice(False, "tagged pair buckets: M->N with checksums or deltas "
                                      "(each rank packs its pair buckets)")
        return ReadsChoice(True, "one-sided reads: M->N, each worker reads its pair buckets "
                                 "out of every rank's shards (rma=True)")

    def _connect(self) -> dict[str, Any]:
        self._broken = None  # (again after a reconnect)
        self._planner, self._last_moved = None, {}  # (a reconnect may choose otherwise)
        info = self.init_info
        self._ucx = acquire_worker()
        port = self._ucx.listen(info.listen_port)
        self.m2n = m2n_wanted(self.ranks, self.source, info.m2n)
        self.reads = self._choose_reads()
        if info.m2n is None and not self.reads.on and not self.m2n \
                and not isinstance(self.client, FleetClient) \
                and may_slice_per_worker(self.collective, self.source, self.updates, self.client):
            self.m2n = True  # 1->N: UCX sends each worker its own copy of a bucket anyway
            # (not into a fleet: one that drops an instance connects again as tagged buckets;
            # a drop under a 1->N plan failed its retry: not yet understood)
            self.reads = ReadsChoice(False, "tagged pair buckets: one sender, each worker sent "
                                            "only what it keeps (1->N; m2n=False sends every "
                                            "worker every bucket)")
        log.info("ucx: %s", self.reads)
        if self.reads.on:
            self._exports = ExportedTensors(self._ucx.context)
        self._staging = [torch.empty(self.bucket_bytes + CHECKSUM_BYTES, dtype=torch.uint8,
                                     device=self.device) for _ in range(self.num_buffers)]
        fragment = receiver_init_dict(info, trainer_address=info.listen_address,
                                      trainer_port=port, session=self._session, m2n=self.m2n)
        if self.m2n:
            return fragment_with_layouts(fragment,
                                         self.source.layouts(self.ranks.sender_index or 0))
        return fragment

    def _backend_stats(self) -> dict[str, Any]:
        return self._last_moved

    def _merge(self, fragments: list[dict[str, Any]]) -> dict[str, Any]:
        """M->N: one init info listing where every rank listens; every rank tags with the
        lead's session (the sources of the plan are kept here)."""
        if not self.m2n:
            return super()._merge(fragments)
        self._planner, fragments = planner_of(fragments, None, self.bucket_bytes)
        first = fragments[0]
        self._session = int(first["session"])
        return {**first, "trainers": [[f["trainer_address"], f["trainer_port"]]
                                      for f in fragments]}

    def _init_receivers(self, receiver_init: dict[str, Any]) -> None:
        assert self._ucx is not None and self.client is not None
        if self.m2n:  # each worker learns its index among all of them, for its hello
            if self.lead:
                self.client.init_each_engine(
                    lambda first, _count: {**receiver_init, "first_worker": first})
            return
        super()._init_receivers(receiver_init)  # each worker connects during its init
        self._endpoints = self._ucx.wait_for_endpoints(self.client.num_workers(),
                                                       self.init_info.timeout_s)

    def _after_init(self) -> None:
        """M->N, on every rank once every worker is initialized: read each worker's hello
        (where to reach it, what it keeps), plan, and (the lead) send each worker the roster
        (`wtransfer_ucx.m2n`)."""
        if not self.m2n:
            return
        assert self._ucx is not None and self.client is not None
        assert self._planner is not None
        timeout_s, ucx = self.init_info.timeout_s, self._ucx
        workers = self.client.num_workers()
        ucx.wait_for_endpoints(workers, timeout_s)  # (each worker's: to see it leave)
        self._endpoints, dests = m2n.read_hellos(ucx, self._session, workers, timeout_s)
        self._planner = Planner(self._planner.sources, dests, self.bucket_bytes)
        if self.lead:  # (each completes once its worker reads it, at its first update)
            self._rosters = [m2n.roster(ucx, ep, self._session, worker, self._planner)
                             for worker, ep in enumerate(self._endpoints)]

    def _outgoing(self, share: Share) -> Outgoing:
        """One-sided reads where they apply (one call: every worker reads each tensor out of
        this process's memory and answers once its reads completed), else the update call
        with the tensor list, then tagged buckets to every worker (one endpoint each),
        packing bucket k+1 while bucket k is on the wire."""
        if self._broken:
            raise LifecycleError(f"ucx sender is unusable after an earlier failure "
                                 f"({self._broken}); create a new one with trainer_init")
        ucx, info = self._ucx, self.init_info
        assert ucx is not None  # connected
        self._updates += 1
        self.last_update_read = False
        if self._planner is not None:
            return self._outgoing_m2n(share, ucx, self._planner)
        update = {**share.listed_tensors(), "update": self._updates}
        if self._exports is not None:
            tensors, share = share.in_place(readable)
            if tensors is not None:
                for device in {t.device for t in tensors if t.is_cuda}:  # the trainer's last
                    torch.cuda.current_stream(device).synchronize()  # writes land before reads
                self.last_update_read = True
                return Outgoing(share, kept=self._exports, opening={
                    **update, "rma": self._exports.update(tensors, share.manifest.metas)})
        staging, endpoints, session = self._staging, self._endpoints, self._session

        def stage(bucket: Bucket, slot: int) -> torch.Tensor:
            data = share.packer.pack_framed(bucket, staging[slot], info.checksum)
            if data.is_cuda:  # the packing copies, before UCX reads the slot
                torch.cuda.current_stream(data.device).synchronize()
            return data

        if self.device.type == "cuda":  # the trainer's last writes land before any send reads
            torch.cuda.current_stream(self.device).synchronize()
        channel: SendChannel[Any] = SendChannel(
            slots=len(staging), max_inflight=MAX_INFLIGHT, stage=stage,
            post=lambda unit, _slot, data: [
                ucx.send(ep, data[0], tag(session, self._updates, unit[0].index))
                for ep in endpoints],
            wait=lambda requests, check: ucx.wait(requests, info.timeout_s, check))
        return Outgoing(share, opening=update, channel=channel)

    def _outgoing_m2n(self, share: Share, ucx: UCXWorker, planner: Planner) -> Outgoing:
        """This rank's pair buckets of the plan (`wtransfer.trainer.pairs`), each staged in a
        free slot and sent to its worker as one message tagged with its place in the plan
        (`wtransfer_ucx.m2n`)."""
        info, staging = self.init_info, self._staging
        plan = planner.plan(share.manifest)
        session, update, endpoints = self._session, self._updates, self._endpoints
        self._rosters = [r for r in self._rosters if not all(q.completed for q in r.requests)]
        if self.device.type == "cuda":  # the trainer's last writes land before any send reads
            torch.cuda.current_stream(self.device).synchronize()
        if self._exports is not None:  # every rank's table, gathered (a collective)
            metas = share.manifest.metas
            shards = LocalShards(metas, share.parts if share.parts is not None
                                 else held_parts(self.source, metas), share.index)
            for device in {t.device for t in shards.locals if t.is_cuda}:  # what made them
                torch.cuda.current_stream(device).synchronize()  # (a quantizing source) ends
            tables = self.ranks.gather(rank_table(self._exports, shards.locals, metas))
            self.last_update_read = all(t is not None for t in tables)
            if self.last_update_read:
                self._last_moved = plan.moved(share.index)
                opening = ({**share.listed_tensors(), "update": update,
                            "plan_digest": plan.digest, "rma_ranks": tables}
                           if share.lead else None)
                return Outgoing(share, opening=opening, kept=self._exports, lead_only=True)
        delta = self.delta if isinstance(self.delta, PairDeltaSender) else None
        part = pair_send(share, plan, self.source, checksum=info.checksum,
                         gather=self.ranks.gather, delta=delta)
        self._last_moved = part.moved

        def stage(bucket: Any, slot: int) -> torch.Tensor:
            data = part.stage(bucket, staging[slot])
            if data.is_cuda:  # the packing copies, before UCX reads the slot
                torch.cuda.current_stream(data.device).synchronize()
            return data

        channel: SendChannel[Any] = SendChannel(
            slots=len(staging), max_inflight=len(staging), stage=stage,
            post=lambda unit, _slot, data: [ucx.send(
                endpoints[unit[0].worker], data[0], tag(session, update, plan.position(unit[0])))],
            wait=lambda requests, check: ucx.wait(requests, info.timeout_s, check))
        opening = ({**share.listed_tensors(), "update": update, **part.opening}
                   if share.lead else None)
        return Outgoing(share, opening=opening, channel=channel, units=part.units)

    def _failed(self, exc: BaseException) -> None:
        """Messages or reads may still be in flight: this sender is not reused."""
        if self._broken is None:
            self._broken = f"{type(exc).__name__}: {exc}"

    def _close(self) -> None:
        if self._exports is not None:
            self._exports.close()
            self._exports = None
        ucx, self._ucx = self._ucx, None
        self._endpoints = []
        self._rosters = []
        if ucx is not None:
            release_worker(ucx)
        self._staging = []
