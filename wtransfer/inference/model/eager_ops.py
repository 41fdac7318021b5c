"""RMSNorm and the rotary rotation in plain torch operations: the reference the fused Triton
kernels are checked against, and what runs where those kernels do not apply."""

from __future__ import annotations

import torch


def rms_norm_eager(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x's last dimension times `weight`, in eager torch operations (float32)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight.float()).to(x.dtype)


def rotate_eager(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embeddings of x [N, heads, head_dim] in eager torch operations (float32)."""
    half = x.shape[-1] // 2
    xf = x.float()
    turned = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * cos + turned * sin).to(x.dtype)
