"""What one trainer rank holds of each tensor it sends, without gathering anything.

A DTensor's placements say it: on each mesh dimension `Shard(d)` cuts dimension d into
`torch.chunk`-like pieces (FSDP2's last shard may be shorter, or empty), `Replicate` copies it.
Torch's own `compute_local_shape_and_global_offset` turns a placement list and this rank's
mesh coordinate into the one box the local tensor is (2-D meshes such as FSDP x TP
included); the replica index counts this rank among those holding the same box (its
coordinate along the replicated mesh dimensions). A tensor that is not a DTensor is held
whole by every rank: replica = this rank's index among the trainer ranks.

`LocalShards` pairs the layouts with the local tensors, so that an M->N sender copies the
boxes it was planned to send straight out of its own shards.
"""

from __future__ import annotations

from typing import Any

import torch

from wtransfer.errors import ConfigError, MetadataError
from wtransfer.packing import DTYPES, TensorMeta, dtype_name, frame, is_dtensor
from wtransfer.records import Box, TensorLayout
from wtransfer.transport.m2n import PairBucket


def dtensor_layout(name: str, tensor: Any) -> TensorLayout:
    """The box DTensor `tensor` holds on this rank, and which replica of it this rank is;
    `ConfigError` for placements that are not one box per rank (`Partial` sums, strided
    shards such as FSDP2 over a tensor-parallel dimension of the same tensor)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    placements = tuple(tensor.placements)
    odd = [p for p in placements if type(p) not in (Shard, Replicate)]
    if odd:
        raise ConfigError(f"{name!r} is placed {odd[0]}: an M->N transfer needs each rank to "
                          "hold one box (Shard or Replicate placements); use m2n=False, which "
                          "gathers it")
    mesh = tensor.device_mesh
    shape = tuple(int(n) for n in tensor.shape)
    local, offset = compute_local_shape_and_global_offset(shape, mesh, placements)
    coordinate = mesh.get_coordinate() or [0] * mesh.ndim
    replica = 0
    for dim, placement in enumerate(placements):
        if isinstance(placement, Replicate):
            replica = replica * mesh.size(dim) + int(coordinate[dim])
    box = Box(offsets=tuple(int(o) for o in offset), lengths=tuple(int(n) for n in local))
    return TensorLayout(name=name, dtype=dtype_name(tensor.dtype), shape=shape, boxes=(box,),
                        replica=replica)


class LocalShards:
    """This rank's part of every tensor of a source: layouts by (sent) name and the local
    tensors they describe (`tensor(index)` for the list's index)."""

    def __init__(self, metas: list[TensorMeta], parts: list[torch.Tensor], replica: int) -> None:
        if len(parts) != len(metas):
            raise MetadataError(f"the source holds {len(parts)} tensors but announced "
                                f"{len(metas)}")
        self.layouts: dict[str, TensorLayout] = {}
        self._locals: list[torch.Tensor] = []
        for meta, part in zip(metas, parts, strict=True):
            if is_dtensor(part):
                layout = dtensor_layout(meta.name, part)
                local = part.to_local()
            else:
                layout = TensorLayout.whole(meta.name, meta.dtype, meta.shape, replica=replica)
                local = part
            if tuple(local.shape) != layout.local_shape:
                raise MetadataError(f"{meta.name!r}: this rank holds {list(local.shape)} but "
                                    f"its placements say {list(layout.local_shape)}")
            if (layout.dtype, layout.shape) != (meta.dtype, meta.shape):
                raise MetadataError(f"{meta.name!r} is {layout.dtype}{list(layout.shape)} but "
                                    f"was announced as {meta.dtype}{list(meta.shape)}")
            self.layouts[meta.name] = layout
            self._locals.append(local.detach())

    @property
    def locals(self) -> list[torch.Tensor]:
        """The local tensors, in the list's order."""
        return list(self._locals)

    def region(self, index: int, name: str, box: Box) -> torch.Tensor:
        """The local view of global region `box` of tensor `index` (named `name`)."""
        return self.layouts[name].view(self._locals[index], box)

    def pack(self, bucket: PairBucket, metas: list[TensorMeta],
             staging: torch.Tensor) -> torch.Tensor:
        """Copy an M->N pair bucket's boxes out of these shards to their offsets in uint8
        `staging`; the bucket's bytes (the first `bucket.nbytes` of it)."""
        for piece in bucket.pieces:
            meta = metas[piece.tensor]
            out = staging[piece.offset: piece.offset + piece.nbytes].view(
                DTYPES[meta.dtype]).view(piece.box.lengths)
            out.copy_(self.region(piece.tensor, meta.name, piece.box), non_blocking=True)
        return staging[:bucket.nbytes]

    def pack_framed(self, bucket: PairBucket, metas: list[TensorMeta], staging: torch.Tensor,
                    checksum: bool) -> torch.Tensor:
        """`pack`, then the bytes to send (with their checksum trailer when asked)."""
        return frame(staging, self.pack(bucket, metas, staging).numel(), checksum)


def held_parts(source: Any, metas: list[TensorMeta]) -> list[torch.Tensor]:
    """The tensors of `source` as this rank holds them, in `metas`' order: its shards, its
    own tensors, or (a source that can promise neither) each one it yields."""
    if source.sharded:
        return list(source.parts())
    held = source.held()
    if held is not None:
        return list(held)
    return [tensor for _, tensor in source.tensors()]


class OwnShardsPacker:
    """The packer of a rank that sends its own shards (M->N): there is nothing to gather, and
    its buckets are packed by the backend from `LocalShards`."""

    peak_bytes = 0

    def direct(self, bucket: Any) -> torch.Tensor:
        """Not used: pair buckets are never direct."""
        raise ConfigError("an M->N transfer has no direct buckets")

    def pack(self, bucket: Any, staging: torch.Tensor) -> None:
        """Not used: the backend packs pair buckets from `LocalShards`."""
        raise ConfigError("an M->N transfer packs its pair buckets from the rank's shards")

    def pack_framed(self, bucket: Any, staging: torch.Tensor, checksum: bool) -> torch.Tensor:
        """Not used (see `pack`)."""
        raise ConfigError("an M->N transfer packs its pair buckets from the rank's shards")

    def finish(self) -> None:
        """Nothing to take part in."""
