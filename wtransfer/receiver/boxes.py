"""The copies of an update whose tensors arrive as boxes read straight out of their senders'
memory (M->N read in place: each box a trainer rank's shard), worked out once per plan.

`plan_boxes` checks the boxes (each inside its tensor, its source the box's bytes, together
covering every announced tensor exactly once) and turns them into a `WholeProgram`: each part
a worker keeps goes into the target's view of it (contiguous parts copied as flat bytes,
checked as they copy where the device can; strided ones in one multi-tensor copy), and the
parts of a tensor the target offers no view of are assembled in a full-size buffer, one
tensor at a time, and loaded.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from wtransfer.errors import MetadataError
from wtransfer.packing import DTYPES, TensorMeta, byte_view
from wtransfer.receiver.programs import WholeProgram
from wtransfer.records import Box

BoxSource = tuple[int, Box, torch.Tensor]
"""(announced tensor index, box of it, flat uint8 bytes of the box in row-major order)."""

Destinations = Callable[[TensorMeta, Box], "list[tuple[Box, torch.Tensor | None]]"]
"""The parts of a box of a tensor that the worker keeps, each with the target's view it goes
to, or None where the target offers none (the tensor is assembled and loaded)."""


def plan_boxes(arrivals: Sequence[BoxSource], metas: Sequence[TensorMeta],
               destinations: Destinations) -> WholeProgram:
    """The copies of `arrivals` (see the module docstring); `MetadataError` where a box does
    not fit its tensor or its source, or the boxes miss or repeat an element."""
    program = WholeProgram(arrivals)
    covered: dict[int, list[Box]] = {}
    for index, box, src in arrivals:
        meta = _checked(index, box, src, metas)
        boxes = covered.setdefault(index, [])
        if any(box.overlaps(b) for b in boxes):
            raise MetadataError(f"tensor {meta.name!r}: elements of box {box} arrived twice")
        boxes.append(box)
    for index, meta in enumerate(metas):
        if sum(b.numel for b in covered.get(index, ())) != Box.whole(meta.shape).numel:
            raise MetadataError(f"the boxes of tensor {meta.name!r} do not cover it")
    assembled: dict[int, list[tuple[Box, torch.Tensor]]] = {}
    for index, box, src in arrivals:
        meta = metas[index]
        dtype = DTYPES[meta.dtype]
        values = src.view(dtype).view(box.lengths)
        for part, dest in destinations(meta, box):
            part_values = values[part.slices_in(box)]
            if dest is None:
                assembled.setdefault(index, []).append((part, part_values))
            else:
                add_copy(program, meta.name, dtype, dest, part_values)
            program.nbytes += part.numel * meta.itemsize
    program.assembled = [(metas[index], parts) for index, parts in assembled.items()]
    return program


def _checked(index: int, box: Box, src: torch.Tensor, metas: Sequence[TensorMeta]
             ) -> TensorMeta:
    """The announced tensor `index`, after checking that `box` lies in it and `src` holds the
    box's bytes, aligned to its elements."""
    if not 0 <= index < len(metas):
        raise MetadataError(f"a box names tensor #{index} but only {len(metas)} were "
                            "announced")
    meta = metas[index]
    if (not box.within(meta.shape) or src.dtype != torch.uint8 or src.dim() != 1
            or src.numel() != box.numel * meta.itemsize or src.data_ptr() % meta.itemsize):
        raise MetadataError(f"box {box} of tensor {meta.name!r} {list(meta.shape)} does not "
                            f"fit it, or its {src.numel()} source bytes do not hold it")
    return meta


def add_copy(program: WholeProgram, name: str, dtype: torch.dtype, dest: torch.Tensor,
              src: torch.Tensor) -> None:
    """Add one copy to a whole update's `program`: as flat bytes (checkable as it copies)
    where both sides are contiguous, else a strided copy whose source the batched finite
    check reads."""
    if src.is_contiguous() and dest.is_contiguous() and dest.dtype == dtype:
        program.copies.append((name, dtype, byte_view(dest), byte_view(src)))
    else:
        program.strided_dests.append(dest)
        program.strided_sources.append(src)
        program.watched.append((name, src))
