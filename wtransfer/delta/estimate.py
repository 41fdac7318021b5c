"""Whether a delta would be dense, told from a sample before paying for it.

A dense delta (most bytes changed: AdamW at a high learning rate) costs a full comparison and
a copy on top of the bytes a full update moves. The sample is one run of `RUN` elements in
every `SAMPLE_EVERY` runs of each tensor (whole tensors under one period), compared bit for
bit with the same runs as last sent: from each tensor's changed fraction, the bytes a delta
would move (a tensor past its sparse limit goes whole). `DeltaSender` asks before each delta
(against its last-sent copy) and at the end of a run of full updates (against a `Sample` the
run's last update kept, a 64th of the model).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from wtransfer.delta.codec import index_dtype_for, sparse_nbytes
from wtransfer.delta.compare import bits
from wtransfer.packing import TensorMeta

RUN = 1024
"""Elements of one sampled run (contiguous: a few cache lines)."""
SAMPLE_EVERY = 64
"""One run is sampled in every this many."""
GROUP_BYTES = 64 << 20
"""A sample moved to another device goes in groups of about this many bytes, one copy each."""


def sampled(flat: torch.Tensor) -> torch.Tensor:
    """The sampled elements of a flat tensor: the first `RUN` of every `RUN * SAMPLE_EVERY`
    (a strided view, no copy), or all of it where it is shorter than one period."""
    period = RUN * SAMPLE_EVERY
    periods = flat.numel() // period
    if not periods:
        return flat
    return flat[: periods * period].view(periods, period)[:, :RUN]


class Sample:
    """The sampled bits of every tensor of an update as sent, on `device`."""

    def __init__(self, metas: Sequence[TensorMeta], tensors: Sequence[torch.Tensor],
                 device: torch.device) -> None:
        self.metas = list(metas)
        self._bits: dict[str, torch.Tensor] = {}
        elsewhere: list[tuple[str, torch.Tensor]] = []
        for meta, tensor in zip(metas, tensors, strict=True):
            runs = sampled(bits(tensor.detach()))
            if runs.device == device:
                self._bits[meta.name] = runs.clone()
            else:  # (a 64th of the tensor: a full-size `bits` copy is not held meanwhile)
                elsewhere.append((meta.name, runs.contiguous()))
        self._bits.update(copied_in_groups(elsewhere, device))

    def of(self, meta: TensorMeta) -> torch.Tensor:
        """`meta`'s sampled bits as sent."""
        return self._bits[meta.name]


def copied_in_groups(named: Sequence[tuple[str, torch.Tensor]], device: torch.device
                     ) -> dict[str, torch.Tensor]:
    """A copy of each tensor on `device`, made as one copy per group of about `GROUP_BYTES`
    of tensors on one device (a tensor per copy would wait for each copy in turn)."""
    out: dict[str, torch.Tensor] = {}
    group: list[tuple[str, torch.Tensor]] = []
    size = 0
    for index, (name, tensor) in enumerate(named):
        group.append((name, tensor))
        size += tensor.numel() * tensor.element_size()
        following = named[index + 1][1].device if index + 1 < len(named) else None
        if size < GROUP_BYTES and following == tensor.device:
            continue  # (a group is of one device: its parts are concatenated there)
        parts: list[torch.Tensor] = []
        offsets: list[int] = []
        offset = 0
        for _, part in group:
            nbytes = part.numel() * part.element_size()
            padded = -(-nbytes // 16) * 16  # (each part starts aligned for its dtype's view)
            flat = part.reshape(-1).view(torch.uint8)
            parts.append(flat if padded == nbytes else
                         torch.cat([flat, flat.new_zeros(padded - nbytes)]))
            offsets.append(offset)
            offset += padded
        moved = torch.cat(parts).to(device)
        for (part_name, part), start in zip(group, offsets, strict=True):
            nbytes = part.numel() * part.element_size()
            out[part_name] = moved[start:start + nbytes].view(part.dtype).view(part.shape)
        group, size = [], 0
    return out


def predicted_moved(metas: Sequence[TensorMeta], now: Sequence[torch.Tensor],
                    before: Callable[[TensorMeta], torch.Tensor],
                    limits: dict[str, int]) -> int:
    """The bytes a delta of `now` against what was sent would move, predicted from the
    sample: `before(meta)` gives the sampled bits as sent (as `sampled` lays them out);
    `limits` the changed elements past which each tensor goes whole (0: it goes whole)."""
    counts: list[torch.Tensor] = []
    sizes: list[int] = []
    for meta, tensor in zip(metas, now, strict=True):
        mine = sampled(bits(tensor.detach()))
        then = before(meta).to(mine.device, non_blocking=mine.is_cuda)  # (a copy to the host
        counts.append((mine != then).sum())  # must have landed before the host reads it)
        sizes.append(mine.numel())
    if len({c.device for c in counts}) == 1:
        changed = torch.stack(counts).tolist()  # (one read for all)
    else:
        changed = [int(c) for c in counts]
    moved = 0
    for meta, count, size in zip(metas, changed, sizes, strict=True):
        estimate = count * meta.numel / size if size else 0.0
        moved += (meta.nbytes if estimate > limits[meta.name] else
                  sparse_nbytes(round(estimate), index_dtype_for(meta.numel), meta.itemsize))
    return moved
