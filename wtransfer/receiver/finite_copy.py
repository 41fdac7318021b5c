"""A copy that checks for NaN and infinity as it goes, one Triton kernel (CUDA only; imported
where Triton is): each value is read once, written, and its exponent bits tested, so refusing
non-finite weights costs no second read of what arrived (`FiniteCheck.copies`)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 8192
"""Values per program."""

EXPONENT: dict[torch.dtype, tuple[torch.dtype, int]] = {
    torch.bfloat16: (torch.int16, 0x7F80),
    torch.float16: (torch.int16, 0x7C00),
    torch.float32: (torch.int32, 0x7F800000),
    torch.float64: (torch.int64, 0x7FF0000000000000),
}
"""Per dtype, the integer of its width and its exponent mask: a value is NaN or infinite when
every exponent bit is set."""


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
