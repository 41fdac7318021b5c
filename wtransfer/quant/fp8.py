"""The FP8 scheme: float8_e4m3fn weights with one float32 scale per 128 x 128 block.

Block scales, not per-output-channel ones: they are what the FP8 checkpoints of DeepSeek-V3,
Kimi-K2 and Qwen3-FP8 carry (``<name>_scale_inv``, the factor that turns the FP8 values back
into weights) and what vLLM's block-FP8 linear method loads, so an engine fed by us and one
loaded from such a checkpoint hold the same kind of tensors; and a tensor-parallel shard cut
at a multiple of 128 rows or columns keeps whole blocks (its scales are a slice of the
scales).

`quantize` is a pure function of the weight's bits (amax per block, divide, round to nearest
FP8, all in float32), so the trainer and the engine, on any device, produce the same bytes.
"""

from __future__ import annotations

import re

import torch

BLOCK = 128
FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)
SCALE_SUFFIX = "_scale_inv"
"""A quantized weight ``X.weight`` travels with its scales ``X.weight_scale_inv``."""

_QUANTIZED = re.compile(r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)"
                        r"\.weight")


def is_quantized(name: str, shape: tuple[int, ...]) -> bool:
    """Whether the FP8 scheme stores checkpoint tensor `name` quantized: the attention and
    MLP projections of every layer; embeddings, norms, routers and the LM head stay in the
    checkpoint's dtype."""
    return len(shape) == 2 and _QUANTIZED.fullmatch(name) is not None


def scale_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """The scales of a weight of `shape`: one per (partial) 128 x 128 block."""
    rows, cols = shape
    return -(-rows // BLOCK), -(-cols // BLOCK)


def _blocks(w: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """`w` (float32) padded with zeros to whole blocks, viewed [R, 128, C, 128]."""
    rows, cols = w.shape
    r, c = scale_shape((rows, cols))
    padded = torch.zeros(r * BLOCK, c * BLOCK, dtype=torch.float32, device=w.device)
    padded[:rows, :cols] = w
    return padded.view(r, BLOCK, c, BLOCK), rows, cols


@torch.no_grad()
def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 weight, float32 scales) of a 2-D weight: per block, scale = amax / 448 (1 for an
    all-zero block) and q = round(w / scale)."""
    blocks, rows, cols = _blocks(weight.detach().float())
    amax = blocks.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(blocks.shape[0] * BLOCK, -1)[:rows, :cols].contiguous(), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The weight an FP8 tensor and its block scales stand for, in `dtype`."""
    rows, cols = q.shape
    full = scale.repeat_interleave(BLOCK, 0)[:rows].repeat_interleave(BLOCK, 1)[:, :cols]
    return (q.float() * full).to(dtype)
