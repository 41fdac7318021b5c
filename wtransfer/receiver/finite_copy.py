"""Copies that check for NaN and infinity as they go, Triton kernels (CUDA only; imported where
Triton is): each value is read once, written, and its exponent bits tested, so refusing
non-finite weights costs no second read of what arrived. One copy per launch
(`FiniteCheck.copies`), or a whole table of copies in one launch (`copy_and_flag_table`, built
once by `wtransfer.receiver.finite.CheckedBatch`)."""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from wtransfer.receiver.finite import EXPONENT

BLOCK = 8192
"""Values per program."""

@triton.jit(do_not_specialize=["flag"])  # (one compile whatever the flag's index)
def _copy_flag_kernel(src_ptr, dst_ptr, n, flags_ptr, flag,  # type: ignore[no-untyped-def]
                      MASK: tl.constexpr, BLOCK: tl.constexpr):
    start = tl.program_id(0).to(tl.int64) * BLOCK
    offsets = start + tl.arange(0, BLOCK)
    inside = offsets < n
    bits = tl.load(src_ptr + offsets, mask=inside, other=0)
    tl.store(dst_ptr + offsets, bits, mask=inside)
    bad = ((bits & MASK) == MASK) & inside
    if tl.max(bad.to(tl.int32), axis=0) > 0:
        tl.store(flags_ptr + flag, 1)


def copy_and_flag(dst: torch.Tensor, src: torch.Tensor, dtype: torch.dtype,
                  flags: torch.Tensor, flag: int) -> None:
    """Copy flat uint8 `src` into `dst` (both on the CUDA device of `flags`, same length, a
    whole number of `dtype` values), queued on that device's current stream; set
    `flags[flag]` (int32) to 1 when a value is NaN or infinite. `dtype` must be one of
    `EXPONENT`."""
    as_int, mask = EXPONENT[dtype]
    source, dest = src.view(as_int), dst.view(as_int)
    n = source.numel()
    if n:
        with torch.cuda.device(flags.device):  # (the calling thread's device may be another)
            _copy_flag_kernel[(triton.cdiv(n, BLOCK),)](source, dest, n, flags, flag,
                                                         MASK=mask, BLOCK=BLOCK, num_warps=8)


@triton.jit
def _copy_flag_table_kernel(table_ptr, base_ptr, flags_ptr,  # type: ignore[no-untyped-def]
                            MASK: tl.constexpr, ALIGN: tl.constexpr, CHUNK: tl.constexpr,
                            BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64) * 4
    src = tl.multiple_of(tl.load(table_ptr + row), ALIGN)
    dst = tl.multiple_of(tl.load(table_ptr + row + 1), ALIGN)
    n = tl.load(table_ptr + row + 2)
    flag = tl.load(table_ptr + row + 3)
    bad = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(0, CHUNK, BLOCK):
        offsets = start + tl.arange(0, BLOCK)
        inside = offsets < n
        bits = tl.load(base_ptr + src + offsets, mask=inside, other=0)
        tl.store(base_ptr + dst + offsets, bits, mask=inside)
        bad = bad | (((bits & MASK) == MASK) & inside).to(tl.int32)
    if tl.max(bad, axis=0) > 0:
        tl.store(flags_ptr + flag, 1)


def copy_and_flag_table(table: torch.Tensor, base: torch.Tensor, dtype: torch.dtype,
                        align: int, chunk: int, flags: torch.Tensor) -> None:
    """Run every copy of `table` (int64 rows of four: source and destination offsets in
    `dtype` elements from `base`'s address, both multiples of `align`; up to `chunk` elements;
    the index in int32 `flags` set to 1 where a value is NaN or infinite), one program per
    row, queued on the current stream of `base`'s device."""
    as_int, mask = EXPONENT[dtype]
    rows = table.numel() // 4
    if not rows:
        return
    with torch.cuda.device(base.device) if base.is_cuda else contextlib.nullcontext():
        # (a host tensor: Triton's interpreter, TRITON_INTERPRET=1, in tests)
        _copy_flag_table_kernel[(rows,)](table, base.view(as_int), flags, MASK=mask,
                                         ALIGN=align, CHUNK=chunk, BLOCK=BLOCK, num_warps=8)
