"""The GPU comparison of a group of tensors in two Triton launches (CUDA only; imported where
Triton is): one compares every tensor of the group word by word against its run of the
last-sent copy, one gathers the changed words from wherever each tensor lies and writes them
into the copy. `GroupTable` holds a group's addresses on the device."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from wtransfer.delta.codec import encode_sparse

BLOCK = 4096
"""8-byte words per program of the comparison (32 KiB of each side)."""
GATHER_BLOCK = 1024
"""Changed words per program of the gather."""


@triton.jit
def block_words(ptrs, words, word0, block_tensor, block_start,  # type: ignore[no-untyped-def]
                copy, program, BLOCK: tl.constexpr):
    """One program's block: its tensor, its words' offsets in the tensor and in the copy's
    run, which of them lie inside the tensor, and the words now and in the copy."""
    tensor = tl.load(block_tensor + program)
    offsets = tl.load(block_start + program) + tl.arange(0, BLOCK)
    inside = offsets < tl.load(words + tensor)
    at = tl.load(word0 + tensor) + offsets
    source = tl.load(ptrs + tensor).to(tl.pointer_type(tl.int64))
    now = tl.load(source + offsets, mask=inside, other=0)
    was = tl.load(copy + at, mask=inside, other=0)
    return tensor, offsets, at, inside, now, was


@triton.jit
def _compare_kernel(ptrs, words, word0, block_tensor, block_start,  # type: ignore[no-untyped-def]
                    copy, mask, BLOCK: tl.constexpr):
    _, _, at, inside, now, was = block_words(ptrs, words, word0, block_tensor, block_start,
                                             copy, tl.program_id(0), BLOCK)
    tl.store(mask + at, (now != was).to(tl.int8), mask=inside)


@triton.jit
def _gather_kernel(ptrs, starts, owner, word, copy,  # type: ignore[no-untyped-def]
                   now_out, was_out, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < n
    tensor = tl.load(owner + offsets, mask=inside, other=0)
    at = tl.load(word + offsets, mask=inside, other=0)
    local = at - tl.load(starts + tensor, mask=inside, other=0)
    source = tl.load(ptrs + tensor, mask=inside, other=0).to(tl.pointer_type(tl.int64))
    now = tl.load(source + local, mask=inside, other=0)
    was = tl.load(copy + at, mask=inside, other=0)
    tl.store(now_out + offsets, now, mask=inside)
    tl.store(was_out + offsets, was, mask=inside)
    tl.store(copy + at, now, mask=inside)


@dataclass(frozen=True, eq=False)
class GroupTable:
    """One group's tensors on the device: each one's address (`ptrs`), 8-byte words and
    first word in the group's run of the copy (`starts`, with the run's end appended), and
    the comparison's programs (which tensor, which word of it each starts at)."""

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


def compare(table: GroupTable, copy_words: torch.Tensor, mask: torch.Tensor) -> None:
    """`mask[w]` (bool) = word w of the run differs from the copy, for every word of the
    table's tensors (other entries untouched); queued on the current stream."""
    with _on(copy_words.device):
        _compare_kernel[(table.block_tensor.numel(),)](
            table.ptrs, table.words, table.starts, table.block_tensor, table.block_start,
            copy_words, mask.view(torch.int8), BLOCK=BLOCK, num_warps=8)


def gather(table: GroupTable, word: torch.Tensor, copy_words: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For ascending changed run words `word`: (each one's tensor in the table, its word
    now, its word in the copy before), the copy then holding the words now."""
    owner = torch.searchsorted(table.starts, word, right=True).sub_(1)
    now, was = torch.empty_like(word), torch.empty_like(word)
    n = word.numel()
    if n:
        with _on(copy_words.device):
            _gather_kernel[(triton.cdiv(n, GATHER_BLOCK),)](
                table.ptrs, table.starts, owner, word, copy_words, now, was, n,
                BLOCK=GATHER_BLOCK, num_warps=4)
    return owner, now, was


def _on(device: torch.device) -> contextlib.AbstractContextManager[object]:
    """Launch on `device` (the calling thread's current CUDA device may be another; on a
    host, Triton's interpreter runs the kernels)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def works_on(device: torch.device) -> bool:
    """Whether both kernels give the eager ops' results on `device` (a probe of three
    tensors, one longer than a program, a few words changed)."""
    gen = torch.Generator().manual_seed(7)
    sizes = [BLOCK + 5, 3, 2 * BLOCK]
    tensors = [torch.randint(-1 << 40, 1 << 40, (n,), generator=gen).to(device)
               for n in sizes]
    copy = torch.cat(tensors)
    changed = torch.tensor([0, BLOCK + 4, BLOCK + 6, copy.numel() - 1], device=device)
    copy[changed] += 1
    want_copy = torch.cat(tensors)
    starts = [0, sizes[0], sizes[0] + sizes[1]]
    table = GroupTable.build(tensors, starts, copy.numel())
    mask = torch.ones(copy.numel(), dtype=torch.bool, device=device)  # each word written
    compare(table, copy, mask)
    word = torch.nonzero(mask).squeeze(1)
    was = copy.index_select(0, word)
    owner, now, was_seen = gather(table, word, copy)
    return (torch.equal(word, changed) and torch.equal(was_seen, was)
            and torch.equal(now, want_copy.index_select(0, word))
            and torch.equal(owner, torch.tensor([0, 0, 1, 2], device=device))
            and torch.equal(copy, want_copy) and _encodes(device))


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
    """Write a group's sparse payloads into uint8 `out` at once. Element i (flat index `index[i]`,
    bits `values[i]`) belongs to tensor `owner[i]`; `layout` has an int64 row per tensor: its
    first element in `index`, its indices' and values' offsets in `out`, its index width (0:
    not encoded)."""
    n = index.numel()
    if n:
        first, index_at, values_at, index_width = layout.unbind(0)
        with _on(out.device):
            _encode_kernel[(triton.cdiv(n, GATHER_BLOCK),)](
                index, values, owner, first, index_at, values_at, index_width, out, n,
                WIDTH=values.element_size(), BLOCK=GATHER_BLOCK, num_warps=4)
