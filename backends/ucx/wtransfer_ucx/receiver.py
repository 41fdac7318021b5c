"""Engine side of the UCX backend: connects to the trainer once, receives tagged buckets."""

from __future__ import annotations

from collections import deque
from typing import Any

import torch

from wtransfer.errors import LifecycleError
from wtransfer.packing import CHECKSUM_BYTES, Bucket, read_checksum_trailer, trailer_length
from wtransfer.receiver import WeightTransferEngine
from wtransfer.receiving import UpdateSession
from wtransfer.target import WeightTarget
from wtransfer_ucx.info import UCXInitInfo, UCXUpdateInfo
from wtransfer_ucx.transport import (
    MAX_INFLIGHT,
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

    def __init__(self, target: WeightTarget, **options: Any) -> None:
        super().__init__(target, **options)
        self._ucx: UCXWorker | None = None
        self._staging: list[torch.Tensor] = []

    def _worker(self) -> UCXWorker:
        if self._ucx is None:
            raise LifecycleError("ucx: the receiver is not connected; the trainer must call "
                                 "init_weight_transfer_engine")
        return self._ucx

    def _init(self, info: UCXInitInfo) -> None:
        if self._ucx is None:  # one context and worker for the receiver's life
            self._ucx = acquire_worker()
        self._ucx.connect(info.trainer_address, info.trainer_port)
        self._staging = [torch.empty(info.bucket_bytes + CHECKSUM_BYTES, dtype=torch.uint8,
                                     device=self.device) for _ in range(info.num_buffers)]

    def _receive(self, info: UCXUpdateInfo, session: UpdateSession) -> None:
        init = self.init_info
        assert init is not None
        plan = session.announce_plan(info.tensors, init.bucket_bytes,
                                     direct_threshold=init.direct_threshold or 0)
        ucx = self._worker()
        free = deque(range(len(self._staging)))
        posted: deque[tuple[Bucket, int, torch.Tensor, object]] = deque()
        upcoming = deque(plan.buckets)
        while upcoming or posted:
            while upcoming and len(posted) < MAX_INFLIGHT and (upcoming[0].direct or free):
                bucket = upcoming.popleft()
                key = tag(init.session, info.update, bucket.index)
                if bucket.direct:
                    slot, data = -1, session.direct_destination(bucket, self.device)
                else:
                    slot = free.popleft()
                    data = self._staging[slot][: trailer_length(bucket.nbytes, init.checksum)]
                posted.append((bucket, slot, data, ucx.recv(data, key)))
            bucket, slot, data, request = posted.popleft()
            ucx.wait([request], init.timeout_s)
            if bucket.direct:
                session.complete_direct(bucket, data)
                continue
            staging = self._staging[slot]
            checksum = read_checksum_trailer(staging, bucket.nbytes) if init.checksum else None
            session.consume(staging, bucket.nbytes, bucket.slices, checksum)
            if staging.is_cuda:
                torch.cuda.current_stream(staging.device).synchronize()
            free.append(slot)

    def _abort(self) -> None:
        if self._ucx is not None:
            self._ucx.worker.cancel_inflight_requests()

    def _shutdown(self) -> None:
        if self._ucx is not None:
            self._ucx.disconnect()
        self._staging = []

    def _close(self) -> None:
        ucx, self._ucx = self._ucx, None
        if ucx is not None:
            release_worker(ucx)
