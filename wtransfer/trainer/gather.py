"""Packing buckets from a sharded source: full tensors are gathered bucket by bucket.

A sharded trainer (FSDP2, any DTensor model) holds each tensor as row shards across its ranks.
Every rank walks the same bucket plan in the same order; for each bucket, the ranks holding rows
of its slices send exactly those rows to the bucket's owner (point-to-point, one batch per
bucket), which assembles them into its staging buffer. So a rank holds at most one bucket's
gathered bytes at a time (plus at most two partial rows per slice), never the full model, and
only the owner receives them. DTensors sharded otherwise (not `Shard(0)` on a 1-D mesh) fall
back to `full_tensor()`, which gathers the whole tensor on every rank.

The owner may call `pack` for its buckets while the transmit of earlier buckets is still on
the wire, so the gather of bucket k+1 overlaps sending bucket k.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from wtransfer.copies import copy_bytes
from wtransfer.errors import ConfigError, MetadataError
from wtransfer.packing import (
    DTYPES,
    Bucket,
    BucketPlan,
    Slice,
    byte_view,
    is_dtensor,
)


def _row_sharded(tensor: Any) -> bool:
    from torch.distributed.tensor import Shard  # (a DTensor exists: its module is loaded)

    mesh = tensor.device_mesh
    return (mesh.ndim == 1 and len(tensor.placements) == 1
            and isinstance(tensor.placements[0], Shard) and tensor.placements[0].dim == 0
            and tensor.dim() > 0)


class _RowShards:
    """Where the rows of a `Shard(0)` DTensor live: torch.chunk boundaries over the mesh."""

    def __init__(self, tensor: Any) -> None:
        self.group = tensor.device_mesh.get_group()
        self.size = dist.get_world_size(self.group)
        self.rows = int(tensor.shape[0])
        self.row_bytes = tensor.element_size() * (tensor.numel() // self.rows if self.rows else 0)
        self.chunk = -(-self.rows // self.size) if self.rows else 0
        self.local = tensor.to_local()

    def rows_of(self, coordinate: int) -> tuple[int, int]:
        start = min(self.rows, coordinate * self.chunk)
        return start, min(self.rows, start + self.chunk)

    def global_rank(self, coordinate: int) -> int:
        return dist.get_global_rank(self.group, coordinate)


class GatheringPacker:
    """A bucket packer over a sharded source, run on every trainer rank (module docstring).
    `owners[i]` is the index (in `senders`, global ranks) of bucket i's sender; that sender calls
    `pack` for its buckets in order, and every rank calls `finish` at the end."""

    def __init__(self, plan: BucketPlan, parts: Sequence[torch.Tensor], owners: Sequence[int],
                 senders: Sequence[int]) -> None:
        if any(b.direct for b in plan.buckets):
            raise ConfigError("a sharded source is packed bucket by bucket: build the plan "
                              "without direct buckets")
        if len(parts) != len(plan.metas):
            raise MetadataError(f"the source holds {len(parts)} tensors but announced "
                                f"{len(plan.metas)}")
        for meta, part in zip(plan.metas, parts, strict=True):
            if part.dtype != DTYPES[meta.dtype] or tuple(part.shape) != meta.shape:
                raise MetadataError(f"source tensor {meta.name!r} is {str(part.dtype)[6:]}"
                                    f"{list(part.shape)} but was announced as {meta.dtype}"
                                    f"{list(meta.shape)}")
        self._plan = plan
        self._parts = list(parts)
        self._owners = list(owners)
        self._senders = list(senders)
        self._me = dist.get_rank()
        self._next = 0
        self._shards: dict[int, _RowShards] = {}
        self._full: tuple[int, torch.Tensor] | None = None
        self.peak_bytes = 0
        """Most gathered bytes this rank held at once (the owner's assembly buffers)."""

    def pack(self, bucket: Bucket, staging: torch.Tensor) -> None:
        """Gather `bucket` (one this rank owns) into `staging`, after taking part in every
        earlier bucket's gather."""
        self._catch_up(bucket.index)
        self._gather(bucket, staging)
        self._next = bucket.index + 1

    def pack_framed(self, bucket: Bucket, staging: torch.Tensor, checksum: bool) -> torch.Tensor:
        """`pack`, then the checksum trailer (see `BucketPacker.pack_framed`)."""
        from wtransfer.packing import frame

        self.pack(bucket, staging)
        return frame(staging, bucket.nbytes, checksum)

    def direct(self, bucket: Bucket) -> torch.Tensor:
        """Not used: plans of sharded sources have no direct buckets."""
        raise ConfigError("direct buckets are not used with sharded sources")

    def finish(self) -> None:
        """Take part in the gathers of every bucket left (other senders' buckets)."""
        self._catch_up(len(self._plan.buckets))
        self._full = None

    def _catch_up(self, index: int) -> None:
        """Take part in the gathers of buckets [next, index) (owned by other ranks)."""
        if index < self._next:
            raise MetadataError(f"bucket {index} packed out of order (next is {self._next})")
        while self._next < index:
            self._gather(self._plan.buckets[self._next], None)
            self._next += 1

    def _row_shards(self, index: int) -> _RowShards:
        shards = self._shards.get(index)
        if shards is None:
            shards = self._shards[index] = _RowShards(self._parts[index])
        return shards

    def _gather(self, bucket: Bucket, staging: torch.Tensor | None) -> None:
        owner = self._senders[self._owners[bucket.index]]
        mine = owner == self._me
        if mine and staging is None:
            raise ConfigError(f"bucket {bucket.index} belongs to this rank: pack it")
        ops: list[dist.P2POp] = []
        assembled: list[tuple[Slice, torch.Tensor, int]] = []  # slice, buffer, buffer offset
        held = 0
        for s in bucket.slices:
            if s.nbytes == 0:
                continue
            part = self._parts[s.tensor]
            if is_dtensor(part) and _row_sharded(part):
                buffer, start = self._rows(s, owner, ops)
                if buffer is not None:
                    assembled.append((s, buffer, start))
                    held += buffer.numel()
            elif is_dtensor(part):
                full = self._full_tensor(s.tensor)
                if mine:
                    assembled.append((s, full, 0))
            elif mine:
                assembled.append((s, byte_view(part.detach()), 0))
        if ops:
            for request in dist.batch_isend_irecv(ops):
                request.wait()
        self.peak_bytes = max(self.peak_bytes, held)
        if mine and staging is not None:
            copy_bytes([staging[s.offset : s.offset + s.nbytes] for s, _, _ in assembled],
                       [buf[s.tensor_offset - start : s.tensor_offset - start + s.nbytes]
                        for s, buf, start in assembled])

    def _rows(self, s: Slice, owner: int, ops: list[dist.P2POp]
              ) -> tuple[torch.Tensor | None, int]:
        """Post this rank's part of gathering the rows under slice `s` to `owner`; on the owner
        returns the assembly buffer and the tensor byte offset where it starts."""
        shards = self._row_shards(s.tensor)
        rb = shards.row_bytes
        r0, r1 = s.tensor_offset // rb, -(-(s.tensor_offset + s.nbytes) // rb)
        local_bytes = byte_view(shards.local.detach())
        buffer = None
        if owner == self._me:
            buffer = torch.empty((r1 - r0) * rb, dtype=torch.uint8, device=local_bytes.device)
        for coordinate in range(shards.size):
            lo, hi = shards.rows_of(coordinate)
            a, b = max(lo, r0), min(hi, r1)
            if a >= b:
                continue
            peer = shards.global_rank(coordinate)
            if buffer is not None:
                into = buffer[(a - r0) * rb : (b - r0) * rb]
                if peer == self._me:
                    into.copy_(local_bytes[(a - lo) * rb : (b - lo) * rb])
                else:
                    ops.append(dist.P2POp(dist.irecv, into, peer=peer, group=shards.group))
            elif peer == self._me:
                ops.append(dist.P2POp(dist.isend, local_bytes[(a - lo) * rb : (b - lo) * rb],
                                      peer=owner, group=shards.group))
        return buffer, r0 * rb

    def _full_tensor(self, index: int) -> torch.Tensor:
        if self._full is None or self._full[0] != index:
            self._full = None  # free the previous one first
            full = self._parts[index].full_tensor()  # type: ignore[attr-defined]
            self._full = (index, byte_view(full.detach()))
            self.peak_bytes = max(self.peak_bytes, self._full[1].numel())
        return self._full[1]
