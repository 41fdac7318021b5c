"""Engine side of the UCX backend: connects to the trainer once, receives tagged buckets (or,
M->N, `wtransfer_ucx.m2n`, only what this worker keeps, from every trainer rank)."""

from __future__ import annotations

from typing import Any

import torch

from wtransfer.errors import LifecycleError, MetadataError
from wtransfer.packing import (
    CHECKSUM_BYTES,
    Bucket,
    read_checksum_trailer,
    trailer_length,
)
from wtransfer.receiver.engine import WeightTransferEngine
from wtransfer.receiver.pairs import PairReceipt
from wtransfer.receiver.session import UpdateSession
from wtransfer.receiver.target import WeightTarget
from wtransfer.records import TensorLayout
from wtransfer.transport.m2n import PairBucket, Planner, whole_layouts
from wtransfer.transport.window import receive_buckets
from wtransfer_ucx import m2n
from wtransfer_ucx.info import CAPABILITIES, UCXInitInfo, UCXUpdateInfo
from wtransfer_ucx.m2n_reads import RankReads
from wtransfer_ucx.remote_reads import ImportedKeys
from wtransfer_ucx.transport import (
    MAX_INFLIGHT,
    Outbox,
    UCXWorker,
    acquire_worker,
    release_worker,
    tag,
)


class UCXReceiver(WeightTransferEngine[UCXInitInfo, UCXUpdateInfo]):
    """Posts receives for `num_buffers` buckets ahead, so receiving bucket k+1 overlaps
    unpacking bucket k; buckets land in device memory when the engine is on CUDA."""

    backend_name = "ucx"
    init_info_cls = UCXInitInfo
    update_info_cls = UCXUpdateInfo
    capabilities = CAPABILITIES

    def __init__(self, target: WeightTarget, **options: Any) -> None:
        super().__init__(target, **options)
        self._ucx: UCXWorker | None = None
        self._ep: Any = None
        """The endpoint to this sender (one-sided reads go through it)."""
        self._keys = ImportedKeys()
        self._rank_reads = RankReads()
        """M->N by reads: the keys of every trainer rank."""
        self._staging: list[torch.Tensor] = []
        self._trainers: list[Any] = []
        """M->N: the endpoint to each trainer rank, in rank order."""
        self._published: dict[str, TensorLayout] = {}
        """M->N: what this worker told the trainer ranks it keeps."""
        self._hellos: list[Outbox] = []
        self._planner: Planner | None = None
        """M->N: the plans between every rank's layouts (from the roster, at the first
        update)."""

    def _worker(self) -> UCXWorker:
        if self._ucx is None:
            raise LifecycleError("ucx: the receiver is not connected; the trainer must call "
                                 "init_weight_transfer_engine")
        return self._ucx

    def _init(self, info: UCXInitInfo) -> None:
        if self._ucx is None:  # one context and worker for the receiver's life
            self._ucx = acquire_worker()
        self._planner = None
        self._rank_reads.close()  # (keys of an earlier sender's ranks)
        if info.m2n:
            self._trainers = [self._ucx.connect(address, port)
                              for address, port in info.trainers]
            kept = self.target.keeps()
            self._published = kept if kept is not None else whole_layouts(
                self.target.metadata())
            me = info.first_worker + self.worker_index
            self._hellos = [m2n.hello(self._ucx, ep, info.session, me, self._published)
                            for ep in self._trainers]
        else:
            self._ep = self._ucx.connect(info.trainer_address, info.trainer_port)
        self._staging = [torch.empty(info.bucket_bytes + CHECKSUM_BYTES, dtype=torch.uint8,
                                     device=self.device) for _ in range(info.num_buffers)]

    def _receive(self, info: UCXUpdateInfo, session: UpdateSession) -> None:
        init = self.init_info
        assert init is not None
        ucx = self._worker()
        if init.m2n:
            self._receive_m2n(info, session, ucx)
            return
        if info.rma is not None:
            if self._ep is None:
                raise LifecycleError("ucx: the endpoint to the trainer was closed after a "
                                     "failed update; create a new sender (trainer_init)")
            manifest = session.announce_listed(self.manifests, info.tensors,
                                               info.tensors_digest)
            self._keys.read_into(
                session, manifest.plan(init.plan_params.with_direct(1)), info.rma,
                self._ep, self.device, budget=init.num_buffers * init.bucket_bytes,
                timeout_s=init.timeout_s, check=ucx.check_peers)
            return
        listed = session.announce_listed(self.manifests, info.tensors, info.tensors_digest)
        plan = listed.plan(init.plan_params)
        staging = self._staging

        def landed(bucket: Bucket, slot: int, data: torch.Tensor) -> None:
            if slot < 0:
                session.complete_direct(bucket, data)
                return
            checksum = (read_checksum_trailer(staging[slot], bucket.nbytes) if init.checksum
                        else None)
            session.consume(staging[slot], bucket.nbytes, bucket.slices, checksum)
            if data.is_cuda:  # unpacked before the slot takes the next bucket
                torch.cuda.current_stream(data.device).synchronize()

        receive_buckets(
            plan.buckets, len(staging), max_inflight=MAX_INFLIGHT,
            destination=lambda bucket: session.direct_destination(bucket, self.device),
            staging=lambda bucket, slot: staging[slot][
                :trailer_length(bucket.nbytes, init.checksum)],
            post=lambda unit, data: ucx.recv(data[0], tag(init.session, info.update,
                                                          unit[0].index)),
            wait=lambda request: ucx.wait([request], init.timeout_s),
            landed=landed,
            temporary=lambda bucket: session.direct_temporary_bytes(bucket, self.device),
            budget=init.num_buffers * init.bucket_bytes)

    def _receive_m2n(self, info: UCXUpdateInfo, session: UpdateSession, ucx: UCXWorker) -> None:
        """Check the plan, then receive this worker's pair buckets in round order, each
        tagged with its place in the plan, and write their boxes into place."""
        init = self.init_info
        assert init is not None
        if not self._trainers:
            raise LifecycleError("ucx: the endpoints to the trainer ranks were closed after a "
                                 "failed update; create a new sender (trainer_init)")
        manifest = session.announce_listed(self.manifests, info.tensors, info.tensors_digest)
        me = init.first_worker + self.worker_index
        if self._planner is None:
            ucx.wait([r for outbox in self._hellos for r in outbox.requests], init.timeout_s)
            self._hellos = []
            self._planner = m2n.read_roster(ucx, init.session, me, init.timeout_s,
                                             init.bucket_bytes)
        plan = self._planner.plan(manifest)
        plan.check(info.plan_digest)
        session.keep_planned(manifest, self._published)
        if info.rma_ranks is not None:
            if info.delta_buckets is not None or init.checksum:
                raise MetadataError("an M->N update by reads carries no deltas or checksums")
            self._rank_reads.read_buckets(
                session, plan.of_worker(me), manifest.metas, self._planner.sources,
                info.rma_ranks, self._trainers, self._staging, timeout_s=init.timeout_s,
                check=ucx.check_peers)
            return
        receipt = PairReceipt(plan, me, info.delta_buckets, session)
        staging = self._staging

        def landed(bucket: PairBucket, slot: int, _data: torch.Tensor) -> None:
            receipt.land(bucket, staging[slot], init.checksum)
            if staging[slot].is_cuda:  # unpacked before the slot takes the next bucket
                torch.cuda.current_stream(staging[slot].device).synchronize()

        receive_buckets(
            receipt.moving, len(staging), max_inflight=len(staging),
            destination=lambda bucket: staging[0],  # never: pair buckets are packed
            staging=lambda bucket, slot: staging[slot][
                :trailer_length(receipt.nbytes(bucket), init.checksum)],
            post=lambda unit, data: ucx.recv(data[0], tag(init.session, info.update,
                                                          plan.position(unit[0]))),
            wait=lambda request: ucx.wait([request], init.timeout_s),
            landed=landed)

    def _abort(self) -> None:
        if self._trainers and self._ucx is not None:  # M->N: every rank's sends to this
            self._ucx.worker.cancel_inflight_requests()  # worker fail now, not at their
            self._rank_reads.close()  # (reads in flight stop with the endpoints)
            self._ucx.disconnect()  # deadline (the sender is unusable after a failure)
            self._trainers = []
            return
        if self._ucx is not None:
            self._ucx.worker.cancel_inflight_requests()
            if self._keys.in_flight:  # reads may still land: cut the endpoint (the sender
                self._keys.close()  # is unusable after a failure anyway)
                self._ucx.disconnect()
                self._ep = None

    def _sender_gone(self) -> str | None:
        if self._ucx is not None and self._ucx.closed_endpoints:
            return "the trainer's UCX endpoint closed (the trainer exited or died)"
        return None

    def _shutdown(self) -> None:
        self._keys.close()  # before the endpoint they were unpacked for
        self._rank_reads.close()
        self._ep = None
        self._trainers = []
        self._hellos = []
        if self._ucx is not None:
            self._ucx.disconnect()
        self._staging = []

    def _close(self) -> None:
        ucx, self._ucx = self._ucx, None
        if ucx is not None:
            release_worker(ucx)
