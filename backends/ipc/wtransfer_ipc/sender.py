"""Trainer side of the IPC backend: owns the staging buffers, packs, signals each bucket."""

from __future__ import annotations

import os
import secrets
from typing import Any

import torch

from wtransfer.engine import TrainerTransferEngine, receiver_init_dict
from wtransfer.packing import Bucket, BucketPlan, metas_to_wire
from wtransfer.sending import send_pipelined
from wtransfer_ipc.cuda import export_buffer
from wtransfer_ipc.info import IPCTrainerInitInfo
from wtransfer_ipc.shm import SharedBuffer


class IPCSender(TrainerTransferEngine[IPCTrainerInitInfo]):
    """Packs buckets into shared staging buffers; each `update_weights` call hands one over.

    With `num_buffers` >= 2, packing bucket k+1 overlaps the receiver unpacking bucket k.
    """

    backend_name = "ipc"
    init_info_cls = IPCTrainerInitInfo

    def _setup(self) -> dict[str, Any]:
        info = self.init_info
        device = self.device = self._staging_device(info.device)
        self._shm: list[SharedBuffer] = []
        token = secrets.token_hex(8)
        if device.type == "cuda":
            self._staging = [torch.empty(info.bucket_bytes, dtype=torch.uint8, device=device)
                             for _ in range(info.num_buffers)]
            buffers: list[Any] = [export_buffer(b, token, i) for i, b in enumerate(self._staging)]
            transport = "cuda"
        elif device.type == "cpu":
            self._shm = SharedBuffer.create_set(info.num_buffers, info.bucket_bytes)
            self._staging = [b.tensor for b in self._shm if b.tensor is not None]
            buffers = [b.name for b in self._shm]
            transport = "shm"
        else:
            raise ValueError(f"ipc: staging on {device.type} devices is not supported")
        return receiver_init_dict(info, transport=transport, buffers=buffers,
                                  sender_pid=os.getpid(), token=token)

    def _init_receivers(self, receiver_init: dict[str, Any]) -> None:
        super()._init_receivers(receiver_init)
        for buf in self._shm:  # every receiver has mapped them: drop the names, keep the memory
            buf.unlink()

    def _send(self, plan: BucketPlan) -> None:
        manifest = metas_to_wire(plan.metas)

        def transmit(bucket: Bucket, slot: int, data: torch.Tensor, checksum: int | None) -> None:
            update: dict[str, Any] = {
                "buffer": slot, "nbytes": bucket.nbytes, "checksum": checksum,
                "slices": [s.to_wire() for s in bucket.slices],
            }
            if bucket.index == 0:
                update["tensors"] = manifest
            self.client.update_weights(update)

        send_pipelined(plan, self.source, self._staging, transmit,
                       checksum=self.init_info.checksum, before_transmit=self._sync)

    def _sync(self, slot: int) -> None:
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def _teardown(self) -> None:
        self._staging = []
        for buf in self._shm:
            buf.close()
        self._shm = []
        if self.device.type == "cuda":
            torch.cuda.ipc_collect()

