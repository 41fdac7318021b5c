"""The block quantizer's kernels: eager torch ops everywhere, and on CUDA one Triton kernel
per weight (`wtransfer.quant.fp8_triton`) used on a device only after it gave the eager
kernels' exact bytes there on a probe (else the eager ones run). ``WTRANSFER_FP8_TRITON=0``
turns the Triton kernel off."""

from __future__ import annotations

import logging
from types import ModuleType

import torch

from wtransfer.transport.device_kernels import CheckedKernels

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)
logger = logging.getLogger(__name__)


TRITON_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
"""Weight dtypes the Triton kernel is checked for and used on (float32 holds their values)."""


def eager_amax(blocks: torch.Tensor) -> torch.Tensor:
    """Float32 amax of each block of `blocks` [..., row blocks, 128, col blocks, 128]: |x|
    and max are exact in a weight dtype that float32 holds (float64 is narrowed first)."""
    if blocks.dtype not in TRITON_DTYPES:
        blocks = blocks.float()
    return blocks.abs().amax(dim=(-3, -1)).float()


def eager_scales(amax: torch.Tensor) -> torch.Tensor:
    """Block scales from per-block amax: amax / 448 (an IEEE division on every device: CUDA
    turns a division by a scalar into a multiplication by its inverse, which rounds
    differently), 1 for an all-zero block."""
    quotient = torch.div(amax, torch.full_like(amax, FP8_MAX))
    return torch.where(amax > 0, quotient, torch.ones_like(amax))


def eager_round(blocks: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """FP8 values of `blocks` divided (in float32) by their block's scale `local`
    [..., row blocks, 1, col blocks, 1], clamped to FP8's range."""
    if blocks.dtype not in TRITON_DTYPES:  # float64: narrowed, as the padded path does
        blocks = blocks.float()
    return torch.div(blocks, local).clamp_(-FP8_MAX, FP8_MAX).to(FP8)


def triton_for(tensor: torch.Tensor) -> ModuleType | None:
    """`wtransfer.quant.fp8_triton` for `tensor` where it reproduced the eager bytes on its
    device (checked once per device) and its dtype is one it was checked for, else None."""
    return _kernels.on(tensor.device) if tensor.dtype in TRITON_DTYPES else None


def _probe(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Weights that exercise rounding [2, 512, 384]: normal values at several scales, an
    all-zero block, -0.0, subnormals, a NaN block and an infinity."""
    gen = torch.Generator().manual_seed(7)
    values = torch.randn(2, 512, 384, generator=gen)
    values[1] *= torch.logspace(-20, 12, 384, base=2.0)
    values[0, :128, :128] = 0.0
    values[0, 128:256, :128] = -0.0
    values[0, 256:260, 128:256] = 1e-40
    values[1, :128, 256:] = 1e5
    if dtype != torch.float16:  # float16 turns 1e5 into infinity already
        values[1, 128:256, :128] *= 1e-30
    values[1, 256, 200] = float("nan")
    values[1, 384, 300] = float("inf")
    return values.to(dtype).to(device)


def _eager_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    *lead, rows, cols = w.shape
    blocks = w.reshape(*lead, rows // 128, 128, cols // 128, 128)
    scale = eager_scales(eager_amax(blocks))
    return eager_round(blocks, scale[..., :, None, :, None]).reshape(w.shape), scale


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _checked(device: torch.device) -> ModuleType | None:
    """The Triton quantizer if it runs on `device` and gives the eager bytes on the probe,
    whole and for a strided box with given scales."""
    try:
        from wtransfer.quant import fp8_triton
        for dtype in TRITON_DTYPES:
            w = _probe(device, dtype)
            want_q, want_scale = _eager_quantize(w)
            q, scale = fp8_triton.quantize(w)
            box = w[:, 128:384, 128:384]
            local = want_scale[:, 1:3, 1:3]
            if not (_same(q, want_q) and torch.equal(scale.view(torch.int32),
                                                     want_scale.view(torch.int32))
                    and _same(fp8_triton.quantize_with(box, local), want_q[:, 128:384, 128:384])):
                logger.warning("the Triton FP8 kernel differs from the eager one on %s (%s):"
                               " using the eager one", device, dtype)
                return None
    except Exception as exc:  # no Triton, no compiler, a launch error: eager still works
        logger.warning("the Triton FP8 kernel is unavailable on %s (%s): using the eager one",
                       device, exc)
        return None
    return fp8_triton


_kernels = CheckedKernels("WTRANSFER_FP8_TRITON", _checked)
"""The Triton quantizer on each CUDA device where it gave the eager bytes on the probe."""
