"""The block quantizer's two passes (amax per block, scale and round) as fused kernels on
CUDA through `torch.compile`, used on a device only after they gave the eager kernels'
exact bytes there (else, and off CUDA, the eager kernels run). ``WTRANSFER_FP8_COMPILE=0``
turns the fused kernels off."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)
logger = logging.getLogger(__name__)


def eager_amax(blocks: torch.Tensor) -> torch.Tensor:
    """Float32 amax of each block of `blocks` [..., row blocks, 128, col blocks, 128]: |x|
    and max are exact in the weight's own dtype, and float32 holds each such value."""
    return blocks.abs().amax(dim=(-3, -1)).float()


def eager_round(blocks: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """FP8 values of `blocks` divided (in float32) by their block's scale `local`
    [..., row blocks, 1, col blocks, 1], clamped to FP8's range."""
    return torch.div(blocks, local).clamp_(-FP8_MAX, FP8_MAX).to(FP8)


def _round(blocks: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    return (blocks.float() / local).clamp(-FP8_MAX, FP8_MAX).to(FP8)


class BlockKernels:
    """The amax and rounding kernels one device uses (`for_device`)."""

    def __init__(self, amax: Callable[[torch.Tensor], torch.Tensor],
                 round_: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], fused: bool
                 ) -> None:
        self.amax = amax
        self.round = round_
        self.fused = fused
        """Whether these are the compiled kernels."""


EAGER = BlockKernels(eager_amax, eager_round, fused=False)
_by_device: dict[torch.device, BlockKernels] = {}
_lock = threading.Lock()


def for_device(device: torch.device) -> BlockKernels:
    """The kernels for tensors on `device`: the fused ones on a CUDA device where they
    reproduced the eager bytes on a probe (checked once per device), else the eager ones."""
    if device.type != "cuda" or os.environ.get("WTRANSFER_FP8_COMPILE", "1") == "0":
        return EAGER
    with _lock:
        kernels = _by_device.get(device)
        if kernels is None:
            kernels = _by_device[device] = _checked(device)
    return kernels


def _probe(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Blocks that exercise rounding: random values over many magnitudes, zeros (an all-zero
    block too), -0.0, subnormals, and each block's extremes."""
    gen = torch.Generator(device="cpu").manual_seed(7)
    values = torch.randn(3, 2, 128, 3, 128, generator=gen) \
        * torch.logspace(-30, 10, 3 * 2 * 128 * 3 * 128, base=2.0).reshape(3, 2, 128, 3, 128)
    values[0, 0, :, 0, :] = 0.0
    values[1, 1, :7, 2, :] = -0.0
    values[2, 0, :3, 1, :5] = 1e-40
    return values.to(dtype).to(device)


def _checked(device: torch.device) -> BlockKernels:
    """The compiled kernels if they compile and match the eager bytes on `device`."""
    try:
        amax = torch.compile(eager_amax, dynamic=True, fullgraph=True)
        round_ = torch.compile(_round, dynamic=True, fullgraph=True)
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            blocks = _probe(device, dtype)
            want_amax = eager_amax(blocks)
            scale = torch.where(want_amax > 0, want_amax / FP8_MAX, torch.ones_like(want_amax))
            local = scale[..., :, None, :, None]
            if not (torch.equal(amax(blocks), want_amax)
                    and torch.equal(round_(blocks, local).view(torch.uint8),
                                    eager_round(blocks, local).view(torch.uint8))):
                logger.warning("fused FP8 kernels differ from the eager ones on %s (%s): "
                               "using the eager ones", device, dtype)
                return EAGER
    except Exception as exc:  # no compiler, no Triton, a backend error: eager still works
        logger.warning("fused FP8 kernels unavailable on %s (%s): using the eager ones",
                       device, exc)
        return EAGER
    return BlockKernels(amax, round_, fused=True)
