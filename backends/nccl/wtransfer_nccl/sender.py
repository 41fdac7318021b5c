"""Trainer side of the NCCL backend: packs buckets and broadcasts them to every worker, or
(M->N, `wtransfer_nccl.m2n`) sends each worker the parts of its own shards that it keeps."""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import torch

from wtransfer.errors import ConfigError, LifecycleError, TransferTimeout
from wtransfer.packing import CHECKSUM_BYTES
from wtransfer.protocol import WeightSyncClient
from wtransfer.records import receiver_init_dict
from wtransfer.trainer.deltas import PairDeltaSender
from wtransfer.trainer.engine import (
    Outgoing,
    Share,
    TrainerTransferEngine,
    resolve_direct_threshold,
)
from wtransfer.trainer.m2n_choice import m2n_wanted, may_slice_per_worker
from wtransfer.trainer.pairs import pair_send
from wtransfer.trainer.plans import staging_device
from wtransfer.trainer.source import WeightSource
from wtransfer.transport.m2n import keeps_part
from wtransfer.transport.tcp_lifeline import LifelineListener
from wtransfer.transport.window import SendChannel
from wtransfer_nccl.group import (
    DIRECT_BATCH,
    DIRECT_FIRST,
    MAX_INFLIGHT,
    Group,
    host_rendezvous,
    join_rendezvous,
    make_group,
    sender_store,
    session_store,
)
from wtransfer_nccl.info import CAPABILITIES, NCCLTrainerInitInfo
from wtransfer_nccl.m2n import (
    Planner,
    m2n_store,
    publish_decision,
    publish_layouts,
    read_layouts,
)


class NCCLSender(TrainerTransferEngine[NCCLTrainerInitInfo]):
    """Rank 0 of the group; `send_weights` overlaps packing bucket k+1 with broadcasting k.

    The receivers' `update_weights` calls run concurrently with the broadcast (they block in
    their receive loop); a receiver failure stops the broadcast at once and surfaces here as
    the receiver's `PeerError`. After any failure the group is torn down: build a new sender.
    """

    backend_name = "nccl"
    init_info_cls = NCCLTrainerInitInfo
    capabilities = CAPABILITIES

    def __init__(self, init_info: NCCLTrainerInitInfo, *, client: WeightSyncClient | None,
                 source: WeightSource, process_group: Any = None) -> None:
        super().__init__(init_info, client=client, source=source, process_group=process_group)
        self.device = staging_device(self.init_info.device, self.source)
        self.transport = "nccl" if self.device.type == "cuda" else "gloo"
        self.direct_threshold = resolve_direct_threshold(
            self.init_info, self.source, 1 if self.device.type == "cuda" else 1 << 20)
        """Tensors this large are broadcast straight from the source into the destination.

        Default: on CUDA, every tensor (1 byte or more), `DIRECT_BATCH` of them per NCCL
        group call: no staging copy on either side, and one launch per group rather than per
        tensor (two H200s over NVLink, raw NCCL, Qwen3-8B shapes: 44.6 ms grouped against
        44.1 ms for one broadcast of every byte, 48.5 ms packed into 1 GiB buckets with the
        copies overlapped, 49.5 ms one launch per tensor). On CPU (gloo), 1 MiB: copies cost
        more there than calls. Checksums and sharded sources need staging, so they turn it off.
        """
        self._group: Group | None = None
        self._server: Any = None
        """The rendezvous server (`dist.TCPStore`) the first sender hosts."""
        self._lifeline: LifelineListener | None = None
        """What the workers connect to so they see this process die (the lead's)."""
        self._broken: str | None = None
        self._staging: list[torch.Tensor] = []
        self.world_size = 0
        """Trainer ranks that send plus every worker (counted at connect)."""
        self._m2n_by_layouts = False
        self._planner: Planner | None = None
        self._last_moved: dict[str, Any] = {}

    def _connect(self) -> dict[str, Any]:
        self._broken = None  # (again after a reconnect)
        self._planner, self._last_moved = None, {}  # (a reconnect may choose otherwise)
        info = self.init_info
        assert self.client is not None
        workers = self.client.num_workers()
        if info.world_size is not None and self.senders + workers != info.world_size:
            raise ConfigError(f"world_size={info.world_size}, but {self.senders} sending "
                              f"trainer rank(s) plus {workers} worker(s) make "
                              f"{self.senders + workers}; set world_size="
                              f"{self.senders + workers}, or leave it out")
        self.world_size = self.senders + workers
        self.m2n = m2n_wanted(self.ranks, self.source, self.init_info.m2n)
        self._m2n_by_layouts = (info.m2n is None and not self.m2n
                                and may_slice_per_worker(self.collective, self.source, self.updates,
                                                     self.client))
        self._staging = [torch.empty(self.bucket_bytes + CHECKSUM_BYTES, dtype=torch.uint8,
                                     device=self.device) for _ in range(self.num_buffers)]
        port = info.master_port
        if self.lead:  # host before any peer is told where: a port taken fails here, clearly
            self._server = host_rendezvous(info.master_address, port, info.timeout_s)
            port = int(self._server.port)
            with contextlib.suppress(OSError):  # no lifeline: a dead trainer is noticed
                self._lifeline = LifelineListener(info.master_address)  # after timeout_s
        return receiver_init_dict(info, master_address=info.master_address,
                                  lifeline_port=self._lifeline.port if self._lifeline else None,
                                  master_port=port, world_size=self.world_size,
                                  rank_offset=self.senders, transport=self.transport,
                                  senders=self.senders, batch=DIRECT_BATCH,
                                  first_batch=DIRECT_FIRST, m2n=self.m2n,
                                  **({"m2n_by_layouts": True} if self._m2n_by_layouts else {}))

    def _backend_stats(self) -> dict[str, Any]:
        return self._last_moved

    def _merge(self, fragments: list[dict[str, Any]]) -> dict[str, Any]:
        """Several senders: they share the lead's rendezvous, namespaced by the lead's
        sender_id (each forms its own group under it), so the lead's init info is everyone's."""
        return fragments[0]

    def _init_receivers(self, receiver_init: dict[str, Any]) -> None:
        """Form this sender's group on a helper thread while every engine joins it from its
        init call (the lead makes that call); engine e's workers get ranks K + (workers of
        the engines before it) + j, K the number of senders."""
        info = self.init_info
        made: dict[str, Any] = {}
        sender = self.ranks.sender_index or 0
        session = str(receiver_init["sender_id"])  # the lead's: every sender joins under it

        def form() -> None:
            try:
                store = (session_store(self._server, session) if self._server is not None
                         else join_rendezvous(str(receiver_init["master_address"]),
                                              int(receiver_init["master_port"]), sender,
                                              session, info.timeout_s))
                if self._m2n_by_layouts:
                    self.m2n = self._decide_m2n(store)
                if self.m2n:
                    made["group"] = self._form_m2n(store, sender)
                    return
                made["group"] = make_group(
                    self.transport, sender_store(store, sender, self.senders), 0,
                    self.world_size - self.senders + 1, info.timeout_s, self.device)
            except BaseException as exc:
                made["error"] = exc

        former = threading.Thread(target=form, name="wtransfer-nccl-rendezvous", daemon=True)
        former.start()
        if self.lead and self.client is not None:
            self.client.init_each_engine(
                lambda first, _count: {**receiver_init, "rank_offset": self.senders + first})
        former.join(info.timeout_s)
        if former.is_alive():
            raise TransferTimeout(f"the group of {self.world_size} ranks did not form within "
                                  f"{info.timeout_s:g}s")
        if "error" in made:
            raise made["error"]
        self._group = made["group"]

    def _decide_m2n(self, store: Any) -> bool:
        """A lone sender's choice (`NCCLInitInfo.m2n_by_layouts`): M->N where some worker keeps
        part of a tensor, else the broadcast; published for every worker."""
        try:
            workers = read_layouts(store, range(self.senders, self.world_size),
                                   self.init_info.timeout_s)
        except Exception as exc:  # the workers that published hear it at once
            publish_decision(store, None, f"{type(exc).__name__}: {exc}")
            raise
        m2n = any(keeps_part(kept) for kept in workers)
        publish_decision(store, m2n)
        return m2n

    def _form_m2n(self, store: Any, sender: int) -> Group:
        """Publish this rank's shards, join the group of every trainer rank and worker, and
        read what everyone holds (`wtransfer_nccl.m2n`)."""
        info = self.init_info
        publish_layouts(store, sender, self.source.layouts(sender))
        group = make_group(self.transport, m2n_store(store), sender, self.world_size,
                           info.timeout_s, self.device)
        everyone = read_layouts(store, range(self.world_size), info.timeout_s)
        self._planner = Planner(everyone[:self.senders], everyone[self.senders:],
                                self.bucket_bytes)
        return group

    def _outgoing(self, share: Share) -> Outgoing:
        """The lead's update call carries the tensor list (or its digest) and blocks in the
        receivers' receive loops; every sender broadcasts its buckets in its own group, up
        to `MAX_INFLIGHT` ahead (a packed one in a free staging slot); the host waits only
        on the oldest broadcast."""
        if self._broken or self._group is None:
            raise LifecycleError(f"nccl sender is unusable after an earlier failure "
                                 f"({self._broken}); create a new one with trainer_init")
        group, info, staging = self._group, self.init_info, self._staging
        if self._planner is not None:
            return self._outgoing_m2n(share, group)
        channel: SendChannel[Any] = SendChannel(
            slots=len(staging), max_inflight=MAX_INFLIGHT, batch=DIRECT_BATCH,
            first=DIRECT_FIRST,
            stage=lambda bucket, slot: share.packer.pack_framed(bucket, staging[slot],
                                                                info.checksum),
            post=lambda _unit, _slot, data: group.broadcast(data),
            wait=lambda pending, check: pending.wait(info.timeout_s, check))
        return Outgoing(share, opening=share.listed_tensors(), channel=channel)

    def _outgoing_m2n(self, share: Share, group: Group) -> Outgoing:
        """This rank's pair buckets of the plan (`wtransfer.trainer.pairs`), each staged in a
        free slot and sent to its worker (rank K + worker) as one message."""
        assert self._planner is not None
        info, staging = self.init_info, self._staging
        plan = self._planner.plan(share.manifest)
        delta = self.delta if isinstance(self.delta, PairDeltaSender) else None
        part = pair_send(share, plan, self.source, checksum=info.checksum,
                         gather=self.ranks.gather, delta=delta)
        self._last_moved = part.moved
        channel: SendChannel[Any] = SendChannel(
            slots=len(staging), max_inflight=MAX_INFLIGHT,
            stage=lambda bucket, slot: part.stage(bucket, staging[slot]),
            post=lambda unit, _slot, data: group.send(data[0], self.senders + unit[0].worker),
            wait=lambda pending, check: pending.wait(info.timeout_s, check))
        opening = ({**share.listed_tensors(), **part.opening}
                   if share.lead else None)
        return Outgoing(share, opening=opening, channel=channel, units=part.units)

    def _failed(self, exc: BaseException) -> None:
        """A failed broadcast leaves the group unusable: tear it down (NCCL would wait)."""
        if self._broken is None:
            self._broken = f"{type(exc).__name__}: {exc}"
        if self._group is not None:
            self._group.abort()

    def _close(self) -> None:
        group, self._group = self._group, None
        if group is not None:
            group.abort() if self._broken else group.close()
        self._server = None
        if self._lifeline is not None:
            self._lifeline.close()
            self._lifeline = None
        self._staging = []
