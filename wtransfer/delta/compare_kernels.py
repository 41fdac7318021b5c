"""The GPU comparison of a group of tensors against the last-sent copy in two Triton launches
(CUDA only; imported where Triton is): one compares every 8-byte word, marking which of its
elements changed, and counts each block's changed elements (a block: a run of one tensor's
words); one reads the marks and the changed words of the blocks that changed and writes
their changed elements' indices and bits at their place in the group's ascending order (the
counts' running total), and the changed words into the copy, unless more changed than it
keeps. One more launch encodes the group's sparse payloads into one buffer. `GroupTable`
holds a group's addresses on the device."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from wtransfer.delta.codec import BITS_VIEW, encode_sparse

BLOCK_ELEMENTS = 2048
"""Elements per block (a block holds this many over the element width's 8-byte words)."""
ENCODE_BLOCK = 1024
"""Changed elements per program of the encoding."""
KEPT_SHARE = 16
"""A scan keeps at most 1/KEPT_SHARE of its group's elements that changed (and no more than
its tensors could send sparse); the counts are always whole."""


@triton.jit
def _count_kernel(ptrs, words, word0, block_tensor, block_start, copy,  # type: ignore[no-untyped-def]
                  changed_words, block_counts, LANES: tl.constexpr, BITS: tl.constexpr,
                  ELEMENT: tl.constexpr, BLOCK: tl.constexpr):
    program = tl.program_id(0)
    tensor = tl.load(block_tensor + program)
    offsets = tl.load(block_start + program) + tl.arange(0, BLOCK)
    inside = offsets < tl.load(words + tensor)
    source = tl.load(ptrs + tensor).to(tl.pointer_type(tl.int64))
    now = tl.load(source + offsets, mask=inside, other=0)
    at = tl.load(word0 + tensor) + offsets
    was = tl.load(copy + at, mask=inside, other=0)
    lane = tl.arange(0, LANES)
    shift = (lane * BITS).to(tl.int64)
    differ = ((((now ^ was)[:, None] >> shift[None, :]) & ELEMENT) != 0).to(tl.int32)
    tl.store(changed_words + at, tl.sum(differ << lane[None, :], axis=1).to(tl.uint8),
             mask=inside)
    tl.store(block_counts + program, tl.sum(tl.sum(differ, axis=1), axis=0))


@triton.jit
def _write_kernel(ptrs, words, word0, block_tensor, block_start, copy,  # type: ignore[no-untyped-def]
                  changed_words, block_counts, kept_counts, kept_ends, total, index_out,
                  values_out, capacity, LANES: tl.constexpr, BITS: tl.constexpr,
                  ELEMENT: tl.constexpr, BLOCK: tl.constexpr):
    program = tl.program_id(0)
    if (tl.load(block_counts + program) > 0) & (tl.load(total) <= capacity):
        tensor = tl.load(block_tensor + program)
        offsets = tl.load(block_start + program) + tl.arange(0, BLOCK)
        inside = offsets < tl.load(words + tensor)
        at = tl.load(word0 + tensor) + offsets
        flags = tl.load(changed_words + at, mask=inside, other=0).to(tl.int32)
        source = tl.load(ptrs + tensor).to(tl.pointer_type(tl.int64))
        now = tl.load(source + offsets, mask=flags != 0, other=0)  # changed words only
        was = tl.load(copy + at, mask=flags != 0, other=0)
        lane = tl.arange(0, LANES)
        shift = (lane * BITS).to(tl.int64)
        marked = (flags[:, None] >> lane[None, :]) & 1
        taken = tl.sum(tl.where(marked != 0, ELEMENT << shift[None, :], 0), axis=1)
        word = was ^ ((now ^ was) & taken)  # (the marked elements only, as counted)
        tl.store(copy + at, word, mask=flags != 0)
        kept = tl.load(kept_counts + program)
        if kept > 0:  # (a tensor over its limit travels whole: its elements are not kept)
            changed = tl.reshape(marked, (BLOCK * LANES,))
            out = (tl.load(kept_ends + program) - kept
                   + (tl.cumsum(changed, axis=0) - changed).to(tl.int64))
            keep = changed != 0
            element = offsets[:, None] * LANES + lane[None, :]
            lanes = (word[:, None] >> shift[None, :]) & ELEMENT
            tl.store(index_out + out, tl.reshape(element, (BLOCK * LANES,)), mask=keep)
            tl.store(values_out + out, tl.reshape(lanes, (BLOCK * LANES,)), mask=keep)


@dataclass(frozen=True, eq=False)
class GroupTable:
    """One group's tensors on the device: each one's address (`ptrs`), 8-byte words and
    first word in the group's run of the copy (`starts`, with the run's end appended), its
    blocks' end (`block_end`: one past its last block), and each block's tensor and first
    word in it."""

    key: tuple[int, ...]
    block: int
    """8-byte words per block."""
    ptrs: torch.Tensor
    words: torch.Tensor
    starts: torch.Tensor
    block_end: torch.Tensor
    block_tensor: torch.Tensor
    block_start: torch.Tensor

    @classmethod
    def build(cls, words: Sequence[torch.Tensor], starts: Sequence[int], end: int, width: int
              ) -> GroupTable:
        """The table of int64 word views `words` of elements `width` bytes wide, the i-th at
        word `starts[i]` of a run of `end` words."""
        device = words[0].device
        key = table_key(words, starts)
        block = BLOCK_ELEMENTS * width // 8
        counts = [w.numel() for w in words]
        blocks = [-(-count // block) for count in counts]
        host = torch.tensor([[w.data_ptr() for w in words], counts, list(starts)],
                            dtype=torch.int64)
        ptrs, numels, begins = host.to(device).unbind(0)
        per_tensor = torch.tensor(blocks, device=device)
        total = sum(blocks)
        block_tensor = torch.repeat_interleave(torch.arange(len(words), device=device),
                                               per_tensor, output_size=total)
        block_end = torch.cumsum(per_tensor, 0)
        block_start = (torch.arange(total, device=device)
                       - (block_end - per_tensor).index_select(0, block_tensor)) * block
        run = torch.cat([begins, torch.tensor([end], device=device)])
        return cls(key, block, ptrs, numels, run, block_end, block_tensor, block_start)


def table_key(words: Sequence[torch.Tensor], starts: Sequence[int]) -> tuple[int, ...]:
    """What a table depends on: where each tensor lies, its size and its run position."""
    return tuple(v for w, s in zip(words, starts, strict=True)
                 for v in (w.data_ptr(), w.numel(), s))


@dataclass(frozen=True, eq=False)
class Scan:
    """What one scan of a group writes: each tensor's count of changed elements (`counts`,
    int64) and how many of them it kept (`kept`: all of them where at most the tensor's
    limit, else none); where the group's kept elements are at most `capacity`, each kept
    element's index in its tensor and bits now, in the group's order. On the way: which
    elements of each word changed, each block's count, kept count and their running
    total (`kept_ends`, 0 first)."""

    limits: torch.Tensor
    counts: torch.Tensor
    kept: torch.Tensor
    index: torch.Tensor
    values: torch.Tensor
    changed_words: torch.Tensor
    """Which elements of each word of the run changed (bit i: element i)."""
    block_counts: torch.Tensor
    block_kept: torch.Tensor
    kept_ends: torch.Tensor

    @property
    def capacity(self) -> int:
        """How many changed elements it keeps."""
        return self.index.numel()

    @classmethod
    def empty(cls, table: GroupTable, elements: int, dtype: torch.dtype,
              index_dtype: torch.dtype, limits: Sequence[int]) -> Scan:
        """The buffers of a scan of `table` (a run of `elements` elements of `dtype`), whose
        i-th tensor sends at most `limits[i]` changed elements sparse; allocated on the
        current stream."""
        device = table.ptrs.device
        capacity = max(min(-(-elements // KEPT_SHARE), sum(limits)), 1)
        blocks = table.block_tensor.numel()
        tensors = table.words.numel()
        return cls(torch.tensor(limits, dtype=torch.int64).to(device),
                   torch.empty(tensors, dtype=torch.int64, device=device),
                   torch.empty(tensors, dtype=torch.int64, device=device),
                   torch.empty(capacity, dtype=index_dtype, device=device),
                   torch.empty(capacity, dtype=dtype, device=device),
                   torch.empty(elements * dtype.itemsize // 8, dtype=torch.uint8, device=device),
                   torch.empty(blocks, dtype=torch.int32, device=device),
                   torch.empty(blocks, dtype=torch.int32, device=device),
                   torch.zeros(blocks + 1, dtype=torch.int64, device=device))

    def with_capacity(self, capacity: int) -> Scan:
        """The same scan keeping at most `capacity` elements (a probe's)."""
        return Scan(self.limits, self.counts, self.kept, self.index[:capacity],
                    self.values[:capacity], self.changed_words, self.block_counts,
                    self.block_kept, self.kept_ends)


def scan(table: GroupTable, copy_words: torch.Tensor, found: Scan, width: int) -> None:
    """Compare the table's tensors (elements `width` bytes wide) with their runs of the copy
    into `found`, and write the changed elements into the copy where the group's kept
    elements are at most `found.capacity` (else leave it as it was); queued on the current
    stream."""
    blocks = table.block_tensor.numel()
    bits = 8 * width
    shape = {"LANES": 8 // width, "BITS": bits, "BLOCK": table.block,
             "ELEMENT": -1 if bits == 64 else (1 << bits) - 1}
    columns = (table.ptrs, table.words, table.starts, table.block_tensor, table.block_start,
               copy_words)
    with _on(copy_words.device):
        _count_kernel[(blocks,)](*columns, found.changed_words, found.block_counts, **shape,
                                 num_warps=4)
        ends = found.kept_ends
        torch.cumsum(found.block_counts, 0, out=ends[1:])
        torch.diff(ends.index_select(0, table.block_end), prepend=ends[:1], out=found.counts)
        sparse = found.counts <= found.limits
        torch.mul(found.counts, sparse, out=found.kept)
        torch.mul(found.block_counts, sparse.index_select(0, table.block_tensor),
                  out=found.block_kept)
        torch.cumsum(found.block_kept, 0, out=ends[1:])
        _write_kernel[(blocks,)](*columns, found.changed_words, found.block_counts,
                                 found.block_kept, ends[1:], ends[-1:], found.index,
                                 found.values, found.capacity, **shape, num_warps=4)


def _on(device: torch.device) -> contextlib.AbstractContextManager[object]:
    """Launch on `device` (the calling thread's current CUDA device may be another; on a
    host, Triton's interpreter runs the kernels)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def works_on(device: torch.device) -> bool:
    """Whether the kernels give the eager ops' results on `device`, for every element width
    and an odd and an even count of blocks (`_scans`); then an encoding."""
    return (all(_scans(device, dtype, blocks) for dtype in BITS_VIEW.values()
                for blocks in (7, 8)) and _encodes(device))


def _scans(device: torch.device, dtype: torch.dtype, blocks: int) -> bool:
    """Three tensors of random bits (the last of `blocks` blocks), elements changed in
    several lanes of a word, across a block and at the ends, scanned: keeping all; with the
    last tensor over its limit (its elements not kept nor written, its copy brought up to
    date); keeping fewer than changed (counts only, the copy as it was)."""
    width = dtype.itemsize
    lanes = 8 // width
    gen = torch.Generator().manual_seed(7 + blocks)
    sizes = [(4 * BLOCK_ELEMENTS + 20) // lanes * lanes, lanes, blocks * BLOCK_ELEMENTS]
    now = torch.randint(-1 << 62, 1 << 62, (sum(sizes) // lanes,), generator=gen
                        ).view(dtype).to(device)
    first = [0, sizes[0], sizes[0] + sizes[1]]
    changed = torch.tensor(
        [1, 2, lanes + 3, 1000, 2047, sizes[0] - 1, first[1], first[2], first[2] + 3,
         first[2] + 2047, first[2] + 2048, now.numel() - 1], device=device)
    owner = torch.tensor([0] * 6 + [1] + [2] * 5, device=device)
    flips = torch.randint(1, 1 << 30, (changed.numel(),), generator=gen).to(device)
    index = changed - torch.tensor(first, device=device).index_select(0, owner)
    table = GroupTable.build([t.view(torch.int64) for t in now.split(sizes)],
                             [f // lanes for f in first], now.numel() // lanes, width)
    counts = torch.tensor([6, 1, 5], device=device)
    right = []
    for limits, capacity in (((6, 1, 5), None), ((6, 1, 4), None), ((6, 1, 5), 11)):
        copy = now.clone()
        copy[changed] ^= flips.to(dtype)
        before = copy.clone()
        found = Scan.empty(table, copy.numel(), dtype, torch.int32, limits)
        if capacity is not None:
            found = found.with_capacity(capacity)
        found.index.fill_(-1)
        scan(table, copy.view(torch.int64), found, width)
        kept = owner <= (2 if limits[2] == 5 else 1)
        n = int(kept.sum())
        if capacity is None:
            right.append(torch.equal(found.counts, counts)
                         and torch.equal(found.index[:n].long(), index[kept])
                         and bool((found.index[n:] == -1).all())
                         and torch.equal(found.values[:n], now[changed[kept]])
                         and torch.equal(copy, now))
        else:
            right.append(torch.equal(found.counts, counts) and torch.equal(copy, before))
    return all(right)


def _encodes(device: torch.device) -> bool:
    """Whether `encode` writes `encode_sparse`'s bytes: a tensor with uint16 indices (its
    values ending off an 8-byte boundary), one with int32 indices, one left out."""
    index = torch.tensor([1, 5, 9, 7, 70_000, 3], dtype=torch.int32, device=device)
    values = torch.tensor([-1, 2, -300, 4, 32767, 9], dtype=torch.int16, device=device)
    owner = torch.tensor([0, 0, 0, 1, 1, 2], device=device)
    layout = torch.tensor([[0, 3, 5], [0, 16, 0], [6, 24, 0], [2, 4, 0]], device=device)
    out = torch.zeros(40, dtype=torch.uint8, device=device)
    encode(index, values, owner, layout, out)
    want = [encode_sparse(values[:3], index[:3], "uint16"),
            encode_sparse(values[3:5], index[3:5], "int32")]
    return (torch.equal(out[:12], want[0]) and torch.equal(out[16:28], want[1])
            and not out[12:16].any() and not out[28:].any())


@triton.jit
def _encode_kernel(index, values, owner, first, index_at, values_at,  # type: ignore[no-untyped-def]
                   index_width, out, n, WIDTH: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < n
    tensor = tl.load(owner + offsets, mask=inside, other=0)
    rank = offsets - tl.load(first + tensor, mask=inside, other=0)
    width = tl.load(index_width + tensor, mask=inside, other=0)
    encoded = inside & (width > 0)
    at = tl.load(index_at + tensor, mask=inside, other=0) + rank * width
    position = tl.load(index + offsets, mask=encoded, other=0).to(tl.int64)
    for byte in tl.static_range(8):  # little-endian, the index dtype's bytes only
        tl.store(out + at + byte, ((position >> (8 * byte)) & 0xFF).to(tl.uint8),
                 mask=encoded & (byte < width))
    at = tl.load(values_at + tensor, mask=inside, other=0) + rank * WIDTH
    value = tl.load(values + offsets, mask=encoded, other=0).to(tl.int64)
    for byte in tl.static_range(WIDTH):
        tl.store(out + at + byte, ((value >> (8 * byte)) & 0xFF).to(tl.uint8), mask=encoded)


def encode(index: torch.Tensor, values: torch.Tensor, owner: torch.Tensor,
           layout: torch.Tensor, out: torch.Tensor) -> None:
    """Write the sparse payloads of a group's changed elements into `out` (uint8) at once:
    element i (its flat index `index[i]`, its bits `values[i]`) belongs to tensor
    `owner[i]`; `layout` (int64, one row per tensor: its first element in `index`, where its
    indices and its values start in `out`, its index width in bytes, 0 for a tensor not
    encoded) places it."""
    n = index.numel()
    if n:
        first, index_at, values_at, index_width = layout.unbind(0)
        with _on(out.device):
            _encode_kernel[(triton.cdiv(n, ENCODE_BLOCK),)](
                index, values, owner, first, index_at, values_at, index_width, out, n,
                WIDTH=values.element_size(), BLOCK=ENCODE_BLOCK, num_warps=4)
