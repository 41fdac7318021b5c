"""Engine side of the NCCL backend: joins the group once, receives every bucket by broadcast,
or (M->N, `wtransfer_nccl.m2n`) only what this worker keeps, from every trainer rank."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from wtransfer.errors import ConfigError, LifecycleError, PeerError
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
from wtransfer.transport.tcp_lifeline import Lifeline
from wtransfer.transport.window import receive_buckets
from wtransfer_nccl.group import (
    MAX_INFLIGHT,
    Group,
    join_rendezvous,
    make_group,
    sender_store,
)
from wtransfer_nccl.info import CAPABILITIES, LIFELINE_CHECK_S, NCCLInitInfo, NCCLUpdateInfo
from wtransfer_nccl.m2n import (
    Planner,
    m2n_store,
    publish_layouts,
    read_decision,
    read_layouts,
    whole_layouts,
)

_LIFELINE_CONNECT_S = 5.0
"""How long a worker's init tries to connect its lifeline before it goes on without one."""


class NCCLReceiver(WeightTransferEngine[NCCLInitInfo, NCCLUpdateInfo]):
    """One worker: rank `rank_offset` (+ its index, for an engine with several workers).

    `update_weights` carries only the tensor list; the receiver derives the same bucket plan
    as the trainer and receives the buckets in order, `num_buffers` posted ahead so receiving
    bucket k+1 overlaps unpacking bucket k.
    """

    backend_name = "nccl"
    init_info_cls = NCCLInitInfo
    update_info_cls = NCCLUpdateInfo
    capabilities = CAPABILITIES

    def __init__(self, target: WeightTarget, **options: Any) -> None:
        super().__init__(target, **options)
        self._groups: list[Group] = []
        """One group per sending trainer rank (index = sender)."""
        self._staging: list[list[torch.Tensor]] = []
        """`num_buffers` staging buffers per sender."""
        self._lifeline: Lifeline | None = None
        """The connection that tells this worker the lead trainer died
        (`wtransfer.transport.tcp_lifeline`)."""
        self._planner: Planner | None = None
        """M->N: the plans between every rank's published layouts."""

    def _init(self, info: NCCLInitInfo) -> None:
        self._planner = None
        if info.transport == "nccl" and self.device.type != "cuda":
            raise ConfigError("the trainer broadcasts CUDA tensors over NCCL; this receiver is "
                              f"on {self.device}: create it with device='cuda:N'")
        rank = info.rank_offset + self.worker_index
        if not info.senders <= rank < info.world_size:
            raise ConfigError(f"worker rank {rank} is outside {info.senders}.."
                              f"{info.world_size - 1}: the engine has more workers than the "
                              "trainer counted in world_size")
        staging_device = self.device if info.transport == "nccl" else torch.device("cpu")
        store = join_rendezvous(info.master_address, info.master_port, rank,
                                info.sender_id or "", info.timeout_s)
        workers = info.world_size - info.senders
        try:
            m2n = info.m2n
            if info.m2n_by_layouts:  # the lead chooses once every worker said what it keeps
                self._publish_kept(store, rank)
                m2n = read_decision(store, info.timeout_s)
            if m2n:
                self._join_m2n(info, store, rank, staging_device)
            for sender in range(info.senders if not m2n else 0):
                self._groups.append(make_group(
                    info.transport, sender_store(store, sender, info.senders),
                    rank - info.senders + 1, workers + 1, info.timeout_s, staging_device))
        except BaseException:
            self._abort()
            raise
        self._staging = [[torch.empty(info.bucket_bytes + CHECKSUM_BYTES, dtype=torch.uint8,
                                      device=staging_device) for _ in range(info.num_buffers)]
                         for _ in range(info.senders if not m2n else 1)]
        if info.lifeline_port is not None:
            self._lifeline = Lifeline(info.master_address, info.lifeline_port,
                                      min(info.timeout_s, _LIFELINE_CONNECT_S))

    def _join_m2n(self, info: NCCLInitInfo, store: Any, rank: int,
                  device: torch.device) -> None:
        """Publish what this worker keeps, join the group of every trainer rank and worker,
        and read what everyone holds."""
        self._publish_kept(store, rank)
        self._groups.append(make_group(info.transport, m2n_store(store), rank, info.world_size,
                                       info.timeout_s, device))
        everyone = read_layouts(store, range(info.world_size), info.timeout_s)
        self._planner = Planner(everyone[:info.senders], everyone[info.senders:],
                                info.bucket_bytes)

    def _publish_kept(self, store: Any, rank: int) -> None:
        kept = self.target.keeps()
        publish_layouts(store, rank, kept if kept is not None
                        else whole_layouts(self.target.metadata()))

    def _sender_gone(self) -> str | None:
        lifeline = self._lifeline
        if lifeline is not None and lifeline.gone():
            return "the trainer's lifeline connection was reset (the trainer exited or died)"
        return None

    def _receive(self, info: NCCLUpdateInfo, session: UpdateSession) -> None:
        if self._planner is not None:
            self._receive_m2n(info, session)
            return
        shares = self._shares(info, session)  # a malformed update is named as such first
        if not self._groups:
            raise LifecycleError("nccl: the group was torn down after a failure; the trainer "
                                 "must call init_weight_transfer_engine again")
        init = self.init_info
        assert init is not None
        if init.senders == 1:
            self._receive_share(self._groups[0], shares[0], self._staging[0], session,
                                threading.Lock(), None)
            return
        lock, stop = threading.Lock(), threading.Event()
        errors: list[BaseException] = []

        def run(sender: int) -> None:
            try:
                self._receive_share(self._groups[sender], shares[sender],
                                    self._staging[sender], session, lock, stop)
            except BaseException as exc:
                errors.append(exc)
                stop.set()

        threads = [threading.Thread(target=run, args=(i,), name=f"wtransfer-nccl-recv-{i}",
                                    daemon=True) for i in range(init.senders)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]

    def _receive_m2n(self, info: NCCLUpdateInfo, session: UpdateSession) -> None:
        """Check the plan, then receive this worker's pair buckets in round order, each from
        its trainer rank into a staging slot, and write their boxes into place."""
        init, planner = self.init_info, self._planner
        assert init is not None and planner is not None
        manifest = session.announce_listed(self.manifests, info.tensors, info.tensors_digest)
        plan = planner.plan(manifest)
        plan.check(info.plan_digest)
        if not self._groups:
            raise LifecycleError("nccl: the group was torn down after a failure; the trainer "
                                 "must call init_weight_transfer_engine again")
        me = self._groups[0].rank - init.senders
        session.keep_planned(manifest, planner.dests[me] if planner.dests else {})
        receipt = PairReceipt(plan, me, info.delta_buckets, session)
        group, staging_buffers = self._groups[0], self._staging[0]
        stopped = self._stop_check(None)
        receive_buckets(
            receipt.moving, len(staging_buffers),
            max_inflight=len(staging_buffers),
            destination=lambda bucket: staging_buffers[0],  # never: pair buckets are packed
            staging=lambda bucket, slot: staging_buffers[slot][
                :trailer_length(receipt.nbytes(bucket), init.checksum)],
            post=lambda unit, data: group.recv(data[0], unit[0].sender),
            wait=lambda pending: pending.wait(init.timeout_s, stopped),
            landed=lambda bucket, slot, _data: receipt.land(bucket, staging_buffers[slot],
                                                            init.checksum))
        if staging_buffers[0].device.type == "cuda":
            torch.cuda.current_stream(staging_buffers[0].device).synchronize()

    def _stop_check(self, stop: threading.Event | None) -> Callable[[], None]:
        """What a wait asks every few microseconds: whether another share failed (`stop`),
        and, every `LIFELINE_CHECK_S`, whether the trainer is gone."""
        next_look = time.monotonic() + LIFELINE_CHECK_S

        def stopped() -> None:
            nonlocal next_look
            if stop is not None and stop.is_set():
                raise PeerError("another sender's share failed")
            if time.monotonic() >= next_look:
                next_look = time.monotonic() + LIFELINE_CHECK_S
                gone = self._sender_gone()
                if gone is not None:
                    raise PeerError(f"a transfer cannot complete: {gone}")

        return stopped

    def _shares(self, info: NCCLUpdateInfo, session: UpdateSession) -> list[tuple[Bucket, ...]]:
        """Announce the update's tensors; each sender's buckets of the plan derived from them
        (planned once per list: a trainer sends the same one every step)."""
        init = self.init_info
        assert init is not None
        manifest = session.announce_listed(self.manifests, info.tensors, info.tensors_digest)
        return manifest.shares(init.plan_params, init.senders)

    def _receive_share(self, group: Group, buckets: tuple[Bucket, ...],
                       staging_buffers: list[torch.Tensor], session: UpdateSession,
                       lock: threading.Lock, stop: threading.Event | None) -> None:
        """Receive one sender's buckets in order. Up to `MAX_INFLIGHT` broadcasts are posted
        ahead (a packed one needs a free staging slot, a direct one lands in the parameter
        itself), so receiving overlaps unpacking. On CUDA the host waits only on the oldest
        broadcast (its deadline and the peer's health): unpacking is ordered after the
        broadcast on the device, and the next broadcast into a slot after the unpack (the
        group's stream waits on the current one), with one synchronize at the end."""
        init = self.init_info
        assert init is not None
        stopped = self._stop_check(stop)
        device = staging_buffers[0].device  # num_buffers >= 1 (checked in the init info)

        def destination(bucket: Bucket) -> torch.Tensor:
            with lock:
                return session.direct_destination(bucket, device)

        def landed(bucket: Bucket, slot: int, data: torch.Tensor) -> None:
            with lock:
                if slot < 0:
                    session.complete_direct(bucket, data)
                    return
                staging = staging_buffers[slot]
                checksum = (read_checksum_trailer(staging, bucket.nbytes) if init.checksum
                            else None)
                session.consume(staging, bucket.nbytes, bucket.slices, checksum)

        receive_buckets(
            buckets, len(staging_buffers), max_inflight=MAX_INFLIGHT, batch=init.batch,
            first=init.first_batch,
            destination=destination,
            staging=lambda bucket, slot: staging_buffers[slot][
                :trailer_length(bucket.nbytes, init.checksum)],
            post=lambda _unit, data: group.broadcast(data),
            wait=lambda pending: pending.wait(init.timeout_s, stopped),
            landed=landed,
            temporary=lambda bucket: session.direct_temporary_bytes(bucket, device),
            budget=init.num_buffers * init.bucket_bytes)
        if device.type == "cuda":  # the weights are in place when this returns
            torch.cuda.current_stream(device).synchronize()

    def _abort(self) -> None:
        groups, self._groups = self._groups, []
        for group in groups:
            group.abort()

    def _shutdown(self) -> None:
        groups, self._groups = self._groups, []
        for group in groups:
            group.close()
        self._staging = []
        if self._lifeline is not None:
            self._lifeline.close()
            self._lifeline = None
