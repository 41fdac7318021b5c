"""FP8 x FP8 matrix products on the tensor cores, for `Fp8Linear` on CUDA.

The weight keeps its 128 x 128 block scales; the activations are quantized per token in
groups of 128 along the inner dimension (1 x 128, the recipe DeepSeek-V3 trained with and the
one vLLM's block-FP8 linear method runs), and cuBLAS multiplies the two with both scales
applied inside the product (`torch.nn.functional.scaled_mm`, blockwise recipes; Hopper with
CUDA 12.9 or later).

Where that product cannot run (CPU, another GPU, an inner or outer dimension that is not whole
blocks, an older torch or cuBLAS), `Fp8Linear` dequantizes the weight instead. Whether it can
is found out once per device and shape class by trying it, and what was found is logged.
"""

from __future__ import annotations

import logging
import threading

import torch
import torch.nn.functional as F

from wtransfer.quant.fp8 import BLOCK, FP8, FP8_MAX, scales_of

log = logging.getLogger(__name__)

_SCALE_ALIGN = 4
"""cuBLAS reads the weight's scales with a leading dimension that is a multiple of 4."""
_TOKEN_ALIGN = 16
"""Tokens are padded to a multiple of 16 rows (the activation scales' leading dimension)."""

_usable: dict[tuple[str, int], bool] = {}
_lock = threading.Lock()


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`x` ([tokens, K], K whole blocks) as FP8 with one float32 scale per token and group of
    128 columns, its rows padded with zeros to a multiple of 16: the values and the scales
    ([rows, K / 128], token-major in memory as cuBLAS reads them)."""
    tokens, inner = x.shape
    rows = -(-tokens // _TOKEN_ALIGN) * _TOKEN_ALIGN
    groups = F.pad(x.float(), (0, 0, 0, rows - tokens)).view(rows, inner // BLOCK, BLOCK)
    scale = scales_of(groups.abs().amax(dim=-1))
    q = (groups / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8).view(rows, inner)
    return q, scale.t().contiguous().t()


def weight_scales(scale_inv: torch.Tensor) -> torch.Tensor:
    """A weight's block scales ([N / 128, K / 128]) laid out as cuBLAS reads them for the
    transposed weight: [K / 128, N / 128], column-major, leading dimension padded to 4."""
    rows, cols = scale_inv.shape
    padded = -(-cols // _SCALE_ALIGN) * _SCALE_ALIGN
    out = scale_inv.new_zeros((rows, padded))
    out[:, :cols] = scale_inv
    return out.t()[:cols]


def _name(device: torch.device) -> str:
    index = device.index if device.index is not None else torch.cuda.current_device()
    return f"{device.type}:{index}"


def _supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    out_features, in_features = weight.shape
    return (x.is_cuda and weight.is_cuda and hasattr(F, "scaled_mm")
            and in_features % BLOCK == 0 and out_features % BLOCK == 0
            and x.dtype in (torch.bfloat16, torch.float16, torch.float32))


def _product(x2: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    q, x_scale = quantize_activations(x2)
    out = F.scaled_mm(q, weight.t(), [x_scale], [F.ScalingType.BlockWise1x128],
                      [weight_scales(scale_inv)], [F.ScalingType.BlockWise128x128],
                      output_dtype=x2.dtype)
    return out[: x2.shape[0]]


def block_scaled_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor
                        ) -> torch.Tensor | None:
    """x @ W^T computed FP8 x FP8 with block scales (`x` quantized 1 x 128, `weight`
    float8_e4m3fn [N, K] with `scale_inv` [N / 128, K / 128]), in x's dtype; None where that
    product does not run here (the caller dequantizes then)."""
    if not _supported(x, weight):
        return None
    key = (_name(x.device), x.dtype.itemsize)
    if _usable.get(key) is False:
        return None
    x2 = x.reshape(-1, x.shape[-1])
    if key in _usable:
        return _product(x2, weight, scale_inv).view(*x.shape[:-1], weight.shape[0])
    with _lock:
        try:
            out = _product(x2, weight, scale_inv)
        except (RuntimeError, NotImplementedError, ValueError, TypeError) as exc:
            _usable[key] = False
            log.info("FP8 block-scaled matmul unavailable on %s (%s); FP8 weights are "
                     "dequantized in the forward", x.device, str(exc).splitlines()[0])
            return None
        _usable[key] = True
        log.info("FP8 block-scaled matmul (cuBLAS, 1x128 activations x 128x128 weights) "
                 "on %s", x.device)
    return out.view(*x.shape[:-1], weight.shape[0])


def block_scaled_usable(device: torch.device | str) -> bool | None:
    """Whether the block-scaled product ran on `device` (None: not tried yet)."""
    found = [v for (dev, _), v in _usable.items() if dev == _name(torch.device(device))]
    return None if not found else all(found)
