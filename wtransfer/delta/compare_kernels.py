"""The GPU comparison of a group of tensors against the last-sent copy in one Triton launch
(CUDA only; imported where Triton is): each program compares a block of one tensor's 8-byte
words with its run of the copy, element by element, and writes the changed elements' indices,
bits and tensor at their place in the group's ascending order, which it learns from the
programs before it (a decoupled look-back: each program publishes its count, then its running
total). One more launch encodes the group's sparse payloads into one buffer. `GroupTable`
holds a group's addresses on the device."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from wtransfer.delta.codec import encode_sparse

BLOCK = 1024
"""8-byte words per program of the scan (8 KiB of each side)."""
ENCODE_BLOCK = 1024
"""Changed elements per program of the encoding."""
KEPT_SHARE = 16
"""A scan keeps the first 1/KEPT_SHARE of its group's elements that changed (the counts are
always whole); a group with more changed is compared tensor by tensor."""

_COUNT = tl.constexpr(1 << 60)
"""A program's published status: its count (or its running total) below this bit, then 1
(count only) or 2 (running total) above it; 0 before it publishes."""


@triton.jit
def _scan_kernel(ptrs, words, word0, block_tensor, block_start, copy,  # type: ignore[no-untyped-def]
                 ticket, status, counts, index_out, values_out, owner_out, capacity,
                 LANES: tl.constexpr, BITS: tl.constexpr, ELEMENT: tl.constexpr,
                 BLOCK: tl.constexpr):
    # programs take their blocks in launch order, so every block before one is being worked
    program = tl.atomic_add(ticket, 1)
    tensor = tl.load(block_tensor + program)
    offsets = tl.load(block_start + program) + tl.arange(0, BLOCK)
    inside = offsets < tl.load(words + tensor)
    source = tl.load(ptrs + tensor).to(tl.pointer_type(tl.int64))
    now = tl.load(source + offsets, mask=inside, other=0)
    was = tl.load(copy + tl.load(word0 + tensor) + offsets, mask=inside, other=0)
    shift = (tl.arange(0, LANES) * BITS).to(tl.int64)
    lanes = (now[:, None] >> shift[None, :]) & ELEMENT
    differ = ((((now ^ was)[:, None] >> shift[None, :]) & ELEMENT) != 0).to(tl.int64)
    changed = tl.reshape(differ, (BLOCK * LANES,))
    count = tl.sum(changed, axis=0)
    tl.atomic_add(counts + tensor, count)
    tl.atomic_xchg(status + program, count + tl.where(program == 0, 2, 1).to(tl.int64) * _COUNT)
    before = count * 0
    look = program - 1
    while look >= 0:  # add the counts before this block up to a running total
        seen = tl.atomic_add(status + look, 0)
        state = seen // _COUNT
        before += tl.where(state != 0, seen % _COUNT, 0)
        look = tl.where(state == 2, -1, tl.where(state != 0, look - 1, look))
    if program > 0:
        tl.atomic_xchg(status + program, before + count + 2 * _COUNT)
    if count > 0:
        at = before + tl.cumsum(changed, axis=0) - changed
        keep = (changed != 0) & (at < capacity)
        element = offsets[:, None] * LANES + tl.arange(0, LANES)[None, :]
        tl.store(index_out + at, tl.reshape(element, (BLOCK * LANES,)), mask=keep)
        tl.store(values_out + at, tl.reshape(lanes, (BLOCK * LANES,)), mask=keep)
        tl.store(owner_out + at, tensor, mask=keep)


@dataclass(frozen=True, eq=False)
class GroupTable:
    """One group's tensors on the device: each one's address (`ptrs`), 8-byte words and
    first word in the group's run of the copy (`starts`, with the run's end appended), and
    the scan's programs (which tensor, which word of it each starts at)."""

    key: tuple[int, ...]
    ptrs: torch.Tensor
    words: torch.Tensor
    starts: torch.Tensor
    block_tensor: torch.Tensor
    block_start: torch.Tensor

    @classmethod
    def build(cls, words: Sequence[torch.Tensor], starts: Sequence[int], end: int
              ) -> GroupTable:
        """The table of int64 word views `words`, the i-th at word `starts[i]` of a run of
        `end` words."""
        device = words[0].device
        key = table_key(words, starts)
        counts = [w.numel() for w in words]
        blocks = [-(-count // BLOCK) for count in counts]
        host = torch.tensor([[w.data_ptr() for w in words], counts, list(starts)],
                            dtype=torch.int64)
        ptrs, numels, begins = host.to(device).unbind(0)
        per_tensor = torch.tensor(blocks, device=device)
        total = sum(blocks)
        block_tensor = torch.repeat_interleave(torch.arange(len(words), device=device),
                                               per_tensor, output_size=total)
        first_block = torch.cumsum(per_tensor, 0) - per_tensor
        block_start = (torch.arange(total, device=device)
                       - first_block.index_select(0, block_tensor)) * BLOCK
        run = torch.cat([begins, torch.tensor([end], device=device)])
        return cls(key, ptrs, numels, run, block_tensor, block_start)


def table_key(words: Sequence[torch.Tensor], starts: Sequence[int]) -> tuple[int, ...]:
    """What a table depends on: where each tensor lies, its size and its run position."""
    return tuple(v for w, s in zip(words, starts, strict=True)
                 for v in (w.data_ptr(), w.numel(), s))


@dataclass(frozen=True, eq=False)
class Scan:
    """What one scan of a group writes: each tensor's count of changed elements (`counts`),
    and for the first `capacity` changed elements of the group in order, each one's index in
    its tensor, its bits now and its tensor (`owner`)."""

    counts: torch.Tensor
    index: torch.Tensor
    values: torch.Tensor
    owner: torch.Tensor
    status: torch.Tensor
    ticket: torch.Tensor

    @property
    def capacity(self) -> int:
        """How many changed elements it keeps."""
        return self.index.numel()

    @classmethod
    def empty(cls, table: GroupTable, elements: int, dtype: torch.dtype,
              index_dtype: torch.dtype) -> Scan:
        """The buffers of a scan of `table` (a run of `elements` elements of `dtype`),
        allocated on the current stream."""
        device = table.ptrs.device
        capacity = max(elements // KEPT_SHARE, BLOCK * 8)
        return cls(torch.zeros(table.words.numel(), dtype=torch.int64, device=device),
                   torch.empty(capacity, dtype=index_dtype, device=device),
                   torch.empty(capacity, dtype=dtype, device=device),
                   torch.empty(capacity, dtype=torch.int32, device=device),
                   torch.zeros(table.block_tensor.numel(), dtype=torch.int64, device=device),
                   torch.zeros(1, dtype=torch.int32, device=device))


def scan(table: GroupTable, copy_words: torch.Tensor, found: Scan, width: int) -> None:
    """Compare the table's tensors (elements `width` bytes wide) with their runs of the copy
    into `found`, queued on the current stream; the copy is left as it was."""
    lanes = 8 // width
    bits = 8 * width
    with _on(copy_words.device):
        _scan_kernel[(table.block_tensor.numel(),)](
            table.ptrs, table.words, table.starts, table.block_tensor, table.block_start,
            copy_words, found.ticket, found.status, found.counts, found.index, found.values,
            found.owner, found.capacity, LANES=lanes, BITS=bits,
            ELEMENT=-1 if bits == 64 else (1 << bits) - 1, BLOCK=BLOCK, num_warps=8)


def _on(device: torch.device) -> contextlib.AbstractContextManager[object]:
    """Launch on `device` (the calling thread's current CUDA device may be another; on a
    host, Triton's interpreter runs the kernels)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def works_on(device: torch.device) -> bool:
    """Whether the kernels give the eager ops' results on `device`: a scan of three tensors
    (one longer than a program, a few elements changed, one scan keeping them all and one
    keeping the first two), then an encoding."""
    gen = torch.Generator().manual_seed(7)
    sizes = [4 * BLOCK + 20, 4, 8 * BLOCK]  # int16 elements
    tensors = [torch.randint(-1 << 15, 1 << 15, (n,), dtype=torch.int16, generator=gen)
               .to(device) for n in sizes]
    copy = torch.cat(tensors)
    changed = torch.tensor([0, 4 * BLOCK + 19, 4 * BLOCK + 21, copy.numel() - 1],
                           device=device)
    copy[changed] += 1
    before = copy.clone()
    starts = [0, sizes[0] // 4, (sizes[0] + sizes[1]) // 4]
    words = [t.view(torch.int64) for t in tensors]
    table = GroupTable.build(words, starts, copy.numel() // 4)
    owner = torch.tensor([0, 0, 1, 2], dtype=torch.int32, device=device)
    index = changed - torch.tensor([0, 0, sizes[0], sizes[0] + sizes[1]], device=device)
    kept = []
    for capacity in (None, 2):
        found = Scan.empty(table, copy.numel(), torch.int16, torch.int32)
        if capacity is not None:
            found = Scan(found.counts, found.index[:capacity], found.values[:capacity],
                         found.owner[:capacity], found.status, found.ticket)
        scan(table, copy.view(torch.int64), found, 2)
        n = found.capacity if capacity is not None else 4
        kept.append(torch.equal(found.counts, torch.tensor([2, 1, 1], device=device))
                    and torch.equal(found.index[:n].long(), index[:n])
                    and torch.equal(found.owner[:n], owner[:n])
                    and torch.equal(found.values[:n], torch.cat(tensors)[changed[:n]]))
    return all(kept) and torch.equal(copy, before) and _encodes(device)


def _encodes(device: torch.device) -> bool:
    """Whether `encode` writes `encode_sparse`'s bytes: a tensor with uint16 indices (its
    values ending off an 8-byte boundary), one with int32 indices, one left out."""
    index = torch.tensor([1, 5, 9, 7, 70_000, 3], dtype=torch.int32, device=device)
    values = torch.tensor([-1, 2, -300, 4, 32767, 9], dtype=torch.int16, device=device)
    owner = torch.tensor([0, 0, 0, 1, 1, 2], dtype=torch.int32, device=device)
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
