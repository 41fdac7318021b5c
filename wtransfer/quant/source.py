"""`Fp8Source`: a trainer's source quantized before it is sent (half the bytes move).

A sharded source (FSDP2, DTensors) is quantized where it lies: each rank takes the largest
|value| of every 128 x 128 block its shard touches, the ranks agree on each block's amax with
one all-reduce (max) of those small tables per mesh, and each rank then quantizes its own
rows with the whole weight's scales: the same bytes as quantizing the gathered weight, with
nothing gathered (a block cut between two ranks' shards included). The FP8 weight keeps the
weight's placements; every rank holds the scales whole.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from wtransfer.packing import TensorMeta, is_dtensor
from wtransfer.quant.fp8 import (
    FP8,
    SCALE_SUFFIX,
    block_amax,
    is_quantized,
    quantize,
    quantize_box,
    scale_shape,
    scales_of,
)
from wtransfer.records import TensorLayout
from wtransfer.trainer.layouts import dtensor_layout
from wtransfer.trainer.source import WeightSource


class Fp8Source(WeightSource):
    """`inner`'s tensors as an FP8 engine stores them: each quantized weight as float8_e4m3fn and
    its float32 block scales (quantized on the trainer's device as sent), others unchanged.
    `keep_buffers` True quantizes an unsharded source's CUDA weights into buffers kept across
    updates (half the weights' bytes); None (default) only once a sender reads in place."""

    def __init__(self, inner: WeightSource, *, keep_buffers: bool | None = None) -> None:
        self.inner = inner
        self.keep_buffers = keep_buffers
        self._buffers: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def metadata(self) -> list[TensorMeta]:
        """The quantized list: ``X.weight`` (float8_e4m3fn) and ``X.weight_scale_inv``."""
        out = []
        for meta in self.inner.metadata():
            if is_quantized(meta.name, meta.shape):
                out.append(TensorMeta(meta.name, "float8_e4m3fn", meta.shape))
                out.append(TensorMeta(meta.name + SCALE_SUFFIX, "float32",
                                      scale_shape(meta.shape)))
            else:
                out.append(meta)
        return out

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Each tensor, quantized weights as (weight, scales)."""
        for name, tensor in self.inner.tensors():
            if is_quantized(name, tuple(tensor.shape)):
                q, scale = quantize(tensor, self._buffer(name, tensor))
                yield name, q
                yield name + SCALE_SUFFIX, scale
            else:
                yield name, tensor

    def read_in_place(self) -> None:
        """A sender reads the tensors in place: keep buffers unless told never to."""
        if self.keep_buffers is None:
            self.keep_buffers = True
        self.inner.read_in_place()

    def _buffer(self, name: str, weight: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The kept (FP8 weight, scales) buffers of `name` (made on first use, or when the
        weight's shape or device changed); None where buffers are not kept."""
        if not (self.keep_buffers and weight.is_cuda):
            return None
        kept = self._buffers.get(name)
        if kept is None or kept[0].shape != weight.shape or kept[0].device != weight.device:
            kept = (torch.empty(weight.shape, dtype=FP8, device=weight.device),
                    torch.empty(scale_shape(tuple(weight.shape)), dtype=torch.float32,
                                device=weight.device))
            self._buffers[name] = kept
        return kept

    @property
    def device(self) -> torch.device | None:
        """As `inner`."""
        return self.inner.device

    @property
    def sharded(self) -> bool:
        """As `inner`."""
        return self.inner.sharded

    def layouts(self, replica: int) -> dict[str, TensorLayout]:
        """As `inner`'s, an FP8 weight placed as its weight and its scales held whole, as
        `parts` makes them (without quantizing anything or agreeing on scales)."""
        inner = self.inner.layouts(replica)
        out: dict[str, TensorLayout] = {}
        for meta in self.inner.metadata():
            held = inner[meta.name]
            if not is_quantized(meta.name, meta.shape):
                out[meta.name] = held
                continue
            out[meta.name] = replace(held, dtype="float8_e4m3fn")
            name = meta.name + SCALE_SUFFIX
            out[name] = TensorLayout.whole(name, "float32", scale_shape(meta.shape),
                                           replica=replica)
        return out

    def parts(self) -> list[torch.Tensor]:
        """This rank's part of every tensor of the quantized list, in `metadata()` order: a
        sharded weight's FP8 values as a DTensor placed like the weight, its scales whole
        (see the module docstring). Collective: every rank of the source's meshes calls it
        together (the sender does, once per update)."""
        metas, held = self.inner.metadata(), self.inner.parts()
        pending: list[tuple[torch.Tensor, tuple[int, ...]]] = []
        tables: list[tuple[Any, torch.Tensor]] = []
        for meta, part in zip(metas, held, strict=True):
            if is_quantized(meta.name, meta.shape) and is_dtensor(part):
                offsets = dtensor_layout(meta.name, part).boxes[0].offsets
                local = part.to_local()
                pending.append((local, offsets))
                tables.append((part.device_mesh, block_amax(local, offsets, meta.shape)))
        agreed = iter(zip(pending, _agree(tables), strict=True))
        out: list[torch.Tensor] = []
        for meta, part in zip(metas, held, strict=True):
            if not is_quantized(meta.name, meta.shape):
                out.append(part)
            elif is_dtensor(part):
                (local, offsets), amax = next(agreed)
                scale = scales_of(amax)
                q = quantize_box(local, offsets, scale)
                out.append(DTensor.from_local(q, part.device_mesh, part.placements,
                                              run_check=False, shape=part.shape,
                                              stride=part.stride()))
                out.append(scale)
            else:
                out.extend(quantize(part))
        return out


def _agree(tables: list[tuple[Any, torch.Tensor]]) -> list[torch.Tensor]:
    """Each (mesh, per-block amax table) as the max over that mesh's ranks, in the order
    given (one all-reduce per mesh dimension of all of a mesh's tables together; the meshes
    in order of first appearance, the same on every rank)."""
    out: list[torch.Tensor] = [table for _, table in tables]
    meshes: dict[Any, list[int]] = {}
    for index, (mesh, _) in enumerate(tables):
        meshes.setdefault(mesh, []).append(index)
    for mesh, indices in meshes.items():
        flat = torch.cat([out[i].flatten() for i in indices])
        for dim in range(mesh.ndim):
            dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=mesh.get_group(dim))
        for i in indices:
            out[i] = flat[: out[i].numel()].view(out[i].shape)
            flat = flat[out[i].numel():]
    return out
