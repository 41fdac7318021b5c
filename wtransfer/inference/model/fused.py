"""One Triton kernel each for RMSNorm and rotary embeddings (CUDA only; imported where Triton
is). Eagerly each is a chain of small kernels (RMSNorm nine, a rotation seven): some fifty per
layer of a decode step (four norms, two rotations), and at small models and batches their
count, not their bytes, sets the step's time. Both compute in float32 as the eager code does
and round once; `layer_kernels` says where they are used."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, size, eps,  # type: ignore[no-untyped-def]
                     WIDTH: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    col = tl.arange(0, WIDTH)
    inside = col < size
    x = tl.load(x_ptr + row * size + col, mask=inside, other=0.0).to(tl.float32)
    scale = tl.rsqrt(tl.sum(x * x, 0) / size + eps)
    w = tl.load(w_ptr + col, mask=inside, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * size + col, (x * scale * w).to(out_ptr.dtype.element_ty),
             mask=inside)


@triton.jit
def _rotate_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, heads,  # type: ignore[no-untyped-def]
                   HALF: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    col = tl.arange(0, HALF)
    at = (token * heads + head) * 2 * HALF + col
    low = tl.load(x_ptr + at).to(tl.float32)
    high = tl.load(x_ptr + at + HALF).to(tl.float32)
    cos_low = tl.load(cos_ptr + token * 2 * HALF + col)
    cos_high = tl.load(cos_ptr + token * 2 * HALF + HALF + col)
    sin_low = tl.load(sin_ptr + token * 2 * HALF + col)
    sin_high = tl.load(sin_ptr + token * 2 * HALF + HALF + col)
    kind = out_ptr.dtype.element_ty
    tl.store(out_ptr + at, (low * cos_low - high * sin_low).to(kind))
    tl.store(out_ptr + at + HALF, (high * cos_high + low * sin_high).to(kind))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x's last dimension (x contiguous, on CUDA) times `weight` (dense, of that
    size), in x's dtype."""
    size = x.shape[-1]
    out = torch.empty_like(x)
    rows = x.numel() // size if size else 0
    if rows:
        with torch.cuda.device(x.device):  # (the calling thread's may be another)
            _rms_norm_kernel[(rows,)](x, weight, out, size, eps,
                                      WIDTH=triton.next_power_of_2(size),
                                      num_warps=4 if size <= 1024 else 8)
    return out


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embeddings of x [N, heads, D] (contiguous, on CUDA, D a power of two) by the
    float32 cos and sin [N, 1, D] (contiguous), in x's dtype."""
    tokens, heads, dim = x.shape
    out = torch.empty_like(x)
    if tokens:
        with torch.cuda.device(x.device):  # (the calling thread's may be another)
            _rotate_kernel[(tokens, heads)](x, cos, sin, out, heads, HALF=dim // 2,
                                            num_warps=1)
    return out
