"""An example third-party backend: each packed bucket travels inline in `update_weights`.

It needs no shared memory and no collective library, so it works wherever the control plane
reaches (across hosts, over `wtransfer.rpc` or HTTP); it is slower than the real backends
because every byte is copied into a message. It exists to show how little a backend is.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

import wtransfer
from wtransfer.packing import Bucket, Slice, metas_from_wire
from wtransfer.receiver.engine import WeightTransferEngine
from wtransfer.receiver.session import UpdateSession
from wtransfer.records import ReceiverInitInfo, TrainerInitInfo, UpdateInfo, receiver_init_dict
from wtransfer.trainer.engine import Outgoing, Share, TrainerTransferEngine
from wtransfer.transport.window import CallChannel


@dataclass(frozen=True, kw_only=True)
class InlineTrainerInitInfo(TrainerInitInfo):
    """Trainer init info of the inline backend (only the common wire parameters)."""

    backend: ClassVar[str] = "inline"


@dataclass(frozen=True, kw_only=True)
class InlineUpdateInfo(UpdateInfo):
    """One bucket's bytes and layout; the first bucket also announces the tensors."""

    tensors: list[Any] | None = None
    data: bytes = b""
    slices: list[Any] = field(default_factory=list)
    checksum: int | None = None


class InlineReceiver(WeightTransferEngine[ReceiverInitInfo, InlineUpdateInfo]):
    """Unpacks the bytes carried by each update call."""

    backend_name = "inline"
    init_info_cls = ReceiverInitInfo
    update_info_cls = InlineUpdateInfo

    def _init(self, info: ReceiverInitInfo) -> None:
        pass

    def _receive(self, info: InlineUpdateInfo, session: UpdateSession) -> None:
        if info.tensors is not None:
            session.announce(metas_from_wire(info.tensors))
        if info.slices:
            data = torch.frombuffer(bytearray(info.data), dtype=torch.uint8) if info.data \
                else torch.empty(0, dtype=torch.uint8)
            session.consume(data, len(info.data), [Slice.from_wire(s) for s in info.slices],
                            info.checksum)

    def _shutdown(self) -> None:
        pass


class InlineSender(TrainerTransferEngine[InlineTrainerInitInfo]):
    """Packs into a local staging buffer and ships its bytes in each update call."""

    backend_name = "inline"
    init_info_cls = InlineTrainerInitInfo

    def _connect(self) -> dict[str, Any]:
        self._staging = [torch.empty(self.bucket_bytes, dtype=torch.uint8)
                         for _ in range(self.num_buffers)]
        return receiver_init_dict(self.init_info)

    def _outgoing(self, share: Share) -> Outgoing:
        """Each bucket's update call carries its bytes (the first also the tensor list)."""

        def stage(bucket: Bucket, slot: int) -> torch.Tensor:
            share.packer.pack(bucket, self._staging[slot])
            return self._staging[slot][: bucket.nbytes]

        def describe(bucket: Bucket, _slot: int, data: torch.Tensor,
                     checksum: int | None) -> dict[str, Any]:
            update: dict[str, Any] = {"data": data.numpy().tobytes(), "checksum": checksum,
                                      "slices": [s.to_wire() for s in bucket.slices]}
            if bucket.index == 0:
                update["tensors"] = share.manifest.wire
            return update

        return Outgoing(share, channel=CallChannel(slots=len(self._staging), stage=stage,
                                                   describe=describe))

    def _close(self) -> None:
        self._staging = []


BACKEND = wtransfer.Backend(
    name="inline",
    receiver="wtransfer_inline:InlineReceiver",
    sender="wtransfer_inline:InlineSender",
    summary="bytes inline on the control plane (example third-party backend)",
)
