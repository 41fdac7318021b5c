"""Engine side of the NCCL backend: joins the group once, receives every bucket by broadcast."""

from __future__ import annotations

from collections import deque
from typing import Any

import torch

from wtransfer.errors import ConfigError, LifecycleError
from wtransfer.packing import (
    CHECKSUM_BYTES,
    Bucket,
    read_checksum_trailer,
    trailer_length,
)
from wtransfer.receiver import WeightTransferEngine
from wtransfer.receiving import UpdateSession
from wtransfer.target import WeightTarget
from wtransfer_nccl.group import Group, Pending, make_group, rendezvous
from wtransfer_nccl.info import NCCLInitInfo, NCCLUpdateInfo


class NCCLReceiver(WeightTransferEngine[NCCLInitInfo, NCCLUpdateInfo]):
    """One worker: rank `rank_offset` (+ its index, for an engine with several workers).

    `update_weights` carries only the tensor list; the receiver derives the same bucket plan
    as the trainer and receives the buckets in order, `num_buffers` posted ahead so receiving
    bucket k+1 overlaps unpacking bucket k.
    """

    backend_name = "nccl"
    init_info_cls = NCCLInitInfo
    update_info_cls = NCCLUpdateInfo

    def __init__(self, target: WeightTarget, **options: Any) -> None:
        super().__init__(target, **options)
        self._group: Group | None = None
        self._staging: list[torch.Tensor] = []

    def _init(self, info: NCCLInitInfo) -> None:
        if info.transport == "nccl" and self.device.type != "cuda":
            raise ConfigError("the trainer broadcasts CUDA tensors over NCCL; this receiver is "
                              f"on {self.device}: create it with device='cuda:N'")
        rank = info.rank_offset + self.worker_index
        staging_device = self.device if info.transport == "nccl" else torch.device("cpu")
        store = rendezvous(info.master_address, info.master_port, rank, info.session,
                           info.timeout_s)
        self._group = make_group(info.transport, store, rank, info.world_size,
                                 info.timeout_s, staging_device)
        self._staging = [torch.empty(info.bucket_bytes + CHECKSUM_BYTES, dtype=torch.uint8,
                                     device=staging_device) for _ in range(info.num_buffers)]

    def _receive(self, info: NCCLUpdateInfo, session: UpdateSession) -> None:
        group = self._group
        if group is None:
            raise LifecycleError("nccl: the group was torn down after a failure; the trainer "
                                 "must call init_weight_transfer_engine again")
        init = self.init_info
        assert init is not None
        plan = session.announce_plan(info.tensors, init.bucket_bytes, align=init.align,
                                     direct_threshold=init.direct_threshold or 0)
        free = deque(range(len(self._staging)))
        posted: deque[tuple[Bucket, int, torch.Tensor, Pending]] = deque()
        upcoming = deque(plan.buckets)
        while upcoming or posted:
            while upcoming and len(posted) < len(self._staging) and (upcoming[0].direct or free):
                bucket = upcoming.popleft()
                if bucket.direct:
                    slot, data = -1, session.direct_destination(bucket, self._staging[0].device)
                else:
                    slot = free.popleft()
                    length = trailer_length(bucket.nbytes, init.checksum)
                    data = self._staging[slot][:length]
                posted.append((bucket, slot, data, group.broadcast(data)))
            bucket, slot, data, pending = posted.popleft()
            pending.wait(init.timeout_s)
            if bucket.direct:
                session.complete_direct(bucket, data)
            else:
                staging = self._staging[slot]
                checksum = read_checksum_trailer(staging, bucket.nbytes) if init.checksum else None
                session.consume(staging, bucket.nbytes, bucket.slices, checksum)
                free.append(slot)
            if data.is_cuda:
                torch.cuda.current_stream(data.device).synchronize()

    def _abort(self) -> None:
        group, self._group = self._group, None
        if group is not None:
            group.abort()

    def _shutdown(self) -> None:
        group, self._group = self._group, None
        if group is not None:
            group.close()
        self._staging = []
