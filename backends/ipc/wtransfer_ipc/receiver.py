"""Engine side of the IPC backend: maps the sender's staging buffers once, unpacks buckets."""

from __future__ import annotations

import os
from typing import Any

import torch

from wtransfer.errors import MetadataError
from wtransfer.packing import Slice, metas_from_wire
from wtransfer.receiver import WeightTransferEngine
from wtransfer.receiving import UpdateSession
from wtransfer.target import WeightTarget
from wtransfer_ipc.cuda import open_buffer
from wtransfer_ipc.info import IPCInitInfo, IPCUpdateInfo
from wtransfer_ipc.shm import SharedBuffer, creator_alive, sweep


class IPCReceiver(WeightTransferEngine[IPCInitInfo, IPCUpdateInfo]):
    """Receives through shared staging memory; each update call consumes one bucket."""

    backend_name = "ipc"
    init_info_cls = IPCInitInfo
    update_info_cls = IPCUpdateInfo

    def __init__(self, target: WeightTarget, **options: Any) -> None:
        super().__init__(target, **options)
        self._shm: list[SharedBuffer] = []
        self._staging: list[torch.Tensor] = []

    def _init(self, info: IPCInitInfo) -> None:
        if info.transport == "shm":
            sweep()
            try:
                for name in info.buffers:
                    if not isinstance(name, str):
                        raise MetadataError("shm buffer names must be strings")
                    self._shm.append(SharedBuffer(name, info.bucket_bytes, create=False))
            except BaseException:
                self._shutdown()  # unmap what was mapped before the failure
                raise
            for buf in self._shm:  # the creator died before it could drop the names
                if not creator_alive(buf.name):
                    buf.remove_name()
            self._staging = [b.tensor for b in self._shm if b.tensor is not None]
        else:
            same = info.sender_pid == os.getpid()
            self._staging = [
                open_buffer(rec, token=info.token, index=i, same_process=same,
                            size=info.bucket_bytes)
                for i, rec in enumerate(info.buffers)
            ]

    def _receive(self, info: IPCUpdateInfo, session: UpdateSession) -> None:
        if info.tensors is not None:
            session.announce(metas_from_wire(info.tensors))
        if not info.slices:
            return
        if not 0 <= info.buffer < len(self._staging):
            raise MetadataError(f"buffer index {info.buffer} out of range "
                                f"[0, {len(self._staging)})")
        staging = self._staging[info.buffer]
        session.consume(staging, info.nbytes, [Slice.from_wire(s) for s in info.slices],
                        info.checksum)
        if staging.is_cuda or self.device.type == "cuda":
            torch.cuda.current_stream(staging.device if staging.is_cuda
                                      else self.device).synchronize()

    def _shutdown(self) -> None:
        self._staging = []
        for buf in self._shm:
            buf.close()
        self._shm = []
