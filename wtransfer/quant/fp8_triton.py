"""The block FP8 quantizer as one Triton kernel (CUDA only; imported where Triton is): each
program reads one 128 x 128 block once, takes its amax (or is given its scale), divides with
IEEE rounding and rounds to FP8 to nearest-even. Non-finite values follow the eager
kernels: a block holding a NaN has scale 1, NaN quotients stay NaN through the clamp."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 128
FP8_MAX = 448.0


@triton.jit
def _quantize_kernel(x_ptr, q_ptr, scale_ptr, x_lead, x_row, x_col, q_lead, q_row,  # type: ignore[no-untyped-def]
                     s_lead, s_row, s_col, GIVEN: tl.constexpr, BLOCK: tl.constexpr,
                     FP8_MAX: tl.constexpr):
    rb = tl.program_id(0)
    cb = tl.program_id(1)
    lead = tl.program_id(2).to(tl.int64)
    rows = (rb * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    cols = (cb * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    x = tl.load(x_ptr + lead * x_lead + rows[:, None] * x_row + cols[None, :] * x_col)
    x = x.to(tl.float32)
    s_at = scale_ptr + lead * s_lead + rb * s_row + cb * s_col
    if GIVEN:
        scale = tl.load(s_at)
    else:
        amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
        has_nan = tl.max(tl.max((x != x).to(tl.int32), axis=1), axis=0) > 0
        scale = tl.where((amax > 0) & (~has_nan), tl.math.div_rn(amax, FP8_MAX), 1.0)
        tl.store(s_at, scale)
    q = tl.math.div_rn(x, tl.full([BLOCK, BLOCK], 1.0, tl.float32) * scale)
    q = tl.where(q != q, q, tl.minimum(tl.maximum(q, -FP8_MAX), FP8_MAX))
    out = q_ptr + lead * q_lead + rows[:, None] * q_row + cols[None, :]
    tl.store(out, q.to(tl.float8e4nv, fp_downcast_rounding="rtne"))


def _as_3d(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(1, *t.shape) if t.dim() == 2 else t.reshape(-1, *t.shape[-2:])


def quantize(weight: torch.Tensor, out: tuple[torch.Tensor, torch.Tensor] | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 weight, float32 block scales) of a CUDA weight [..., rows, cols] of whole
    blocks; written into `out` (contiguous, of those shapes) when given."""
    x = _as_3d(weight)
    lead, rows, cols = x.shape
    if out is None:
        out = (torch.empty(weight.shape, dtype=torch.float8_e4m3fn, device=x.device),
               torch.empty(*weight.shape[:-2], rows // BLOCK, cols // BLOCK,
                           dtype=torch.float32, device=x.device))
    _launch(x, _as_3d(out[0]), out[1].view(lead, rows // BLOCK, cols // BLOCK), given=False)
    return out


def quantize_with(part: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """The FP8 values of a CUDA box `part` [..., rows, cols] of whole blocks, given each
    block's scale `local` [..., row blocks, col blocks]."""
    x = _as_3d(part)
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    _launch(x, q, _as_3d(local), given=True)
    return q.reshape(part.shape)


def _launch(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, given: bool) -> None:
    lead, rows, cols = x.shape
    grid = (rows // BLOCK, cols // BLOCK, lead)
    with torch.cuda.device(x.device):
        _quantize_kernel[grid](x, q, scale, x.stride(0), x.stride(1), x.stride(2),
                               q.stride(0), q.stride(1), scale.stride(0), scale.stride(1),
                               scale.stride(2), GIVEN=given, BLOCK=BLOCK, FP8_MAX=FP8_MAX,
                               num_warps=8)
