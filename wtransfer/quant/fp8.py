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

from wtransfer.quant.fused import FP8, FP8_MAX, eager_amax, eager_round, eager_scales, triton_for

BLOCK = 128
SCALE_SUFFIX = "_scale_inv"
"""A quantized weight ``X.weight`` travels with its scales ``X.weight_scale_inv``."""

_QUANTIZED = re.compile(r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)"
                        r"\.weight")
_EXPERTS = re.compile(r"model\.layers\.\d+\.mlp\.experts\.(gate_up|down)_proj")
"""A mixture-of-experts layer's fused experts, [experts, rows, cols] (transformers' names)."""


def is_quantized(name: str, shape: tuple[int, ...]) -> bool:
    """Whether the FP8 scheme stores checkpoint tensor `name` quantized: the attention and
    MLP projections of every layer, and the fused experts of every MoE layer (each expert's
    matrix on its own blocks); embeddings, norms, routers and the LM head stay in the
    checkpoint's dtype."""
    if len(shape) == 3:
        return _EXPERTS.fullmatch(name) is not None
    return len(shape) == 2 and _QUANTIZED.fullmatch(name) is not None


def scale_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The scales of a weight of `shape` ([..., rows, cols]): one per (partial) 128 x 128
    block of each matrix."""
    *lead, rows, cols = shape
    return (*lead, -(-rows // BLOCK), -(-cols // BLOCK))


@torch.no_grad()
def block_amax(part: torch.Tensor, offsets: tuple[int, ...], shape: tuple[int, ...]
               ) -> torch.Tensor:
    """The largest |value| `part` holds in each 128 x 128 block of a weight of `shape`, where
    `part` is the box of it starting at `offsets` (0 for blocks it does not touch): the
    element-wise max of every rank's result is the whole weight's amax per block."""
    out = torch.zeros(scale_shape(shape), dtype=torch.float32, device=part.device)
    if part.numel() == 0:
        return out
    *lead_off, r0, c0 = offsets
    *_, nr, nc = part.shape
    index = tuple(slice(o, o + n) for o, n in zip(lead_off, part.shape[:-2], strict=True))
    if _whole_blocks(offsets, part.shape):  # a view of the blocks: no padded copy
        rb, cb = nr // BLOCK, nc // BLOCK
        blocks = part.detach().reshape(*part.shape[:-2], rb, BLOCK, cb, BLOCK)
        out[(*index, slice(r0 // BLOCK, r0 // BLOCK + rb),
             slice(c0 // BLOCK, c0 // BLOCK + cb))] = eager_amax(blocks)
        return out
    top, left = r0 % BLOCK, c0 % BLOCK
    rb, cb = -(-(top + nr) // BLOCK), -(-(left + nc) // BLOCK)
    padded = torch.zeros(*part.shape[:-2], rb * BLOCK, cb * BLOCK, dtype=torch.float32,
                         device=part.device)
    padded[..., top:top + nr, left:left + nc] = part.detach().float().abs()
    amax = padded.view(*part.shape[:-2], rb, BLOCK, cb, BLOCK).amax(dim=(-3, -1))
    out[(*index, slice(r0 // BLOCK, r0 // BLOCK + rb), slice(c0 // BLOCK, c0 // BLOCK + cb))] \
        = amax
    return out


@torch.no_grad()
def quantize(weight: torch.Tensor, out: tuple[torch.Tensor, torch.Tensor] | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 weight, float32 scales) of a weight [..., rows, cols]: per block of each matrix,
    scale = amax / 448 (1 for an all-zero block) and q = round(w / scale); the whole weight
    as one box (`block_amax`, `quantize_box`), or one fused kernel on CUDA. Written into
    `out` (contiguous tensors of those shapes and dtypes) when given."""
    if out is not None:
        _check_out(weight, out)
    origin = (0,) * weight.dim()
    fused = triton_for(weight)
    if fused is not None and _whole_blocks(origin, weight.shape) and weight.numel():
        return fused.quantize(weight.detach(), out)
    scale = scales_of(block_amax(weight, origin, tuple(weight.shape)))
    q = quantize_box(weight, origin, scale)
    if out is None:
        return q, scale
    out[0].copy_(q)
    out[1].copy_(scale)
    return out


def _check_out(weight: torch.Tensor, out: tuple[torch.Tensor, torch.Tensor]) -> None:
    want = ((tuple(weight.shape), FP8), (scale_shape(tuple(weight.shape)), torch.float32))
    for buffer, (shape, dtype) in zip(out, want, strict=True):
        if (tuple(buffer.shape) != shape or buffer.dtype != dtype
                or buffer.device != weight.device or not buffer.is_contiguous()):
            raise ValueError(f"quantize: out must be contiguous {dtype} {list(shape)} tensors "
                             f"on {weight.device}; got {buffer.dtype} {list(buffer.shape)} "
                             f"on {buffer.device}")


def scales_of(amax: torch.Tensor) -> torch.Tensor:
    """Block scales from per-block amax: amax / 448, 1 for an all-zero block."""
    return eager_scales(amax)


@torch.no_grad()
def quantize_box(part: torch.Tensor, offsets: tuple[int, ...], scale: torch.Tensor
                 ) -> torch.Tensor:
    """The FP8 values of `part`, the box of a weight starting at `offsets`, given the whole
    weight's block scales: the same bytes as that box of `quantize(weight)`."""
    *lead_off, r0, c0 = offsets
    *_, nr, nc = part.shape
    index = tuple(slice(o, o + n) for o, n in zip(lead_off, part.shape[:-2], strict=True))
    if _whole_blocks(offsets, part.shape) and part.numel():  # scales broadcast over blocks
        rb, cb = nr // BLOCK, nc // BLOCK
        blocks = part.detach().reshape(*part.shape[:-2], rb, BLOCK, cb, BLOCK)
        local = scale[(*index, slice(r0 // BLOCK, r0 // BLOCK + rb),
                       slice(c0 // BLOCK, c0 // BLOCK + cb))]
        fused = triton_for(part)
        if fused is not None:
            return fused.quantize_with(part.detach(), local)
        return eager_round(blocks, local[..., :, None, :, None]).reshape(part.shape)
    rows = (torch.arange(nr, device=part.device) + r0) // BLOCK
    cols = (torch.arange(nc, device=part.device) + c0) // BLOCK
    local = scale[index][..., rows[:, None], cols[None, :]]
    return (part.detach().float() / local).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def _whole_blocks(offsets: tuple[int, ...], shape: tuple[int, ...] | torch.Size) -> bool:
    """Whether a box at `offsets` of `shape` covers whole 128 x 128 blocks only."""
    return all(n % BLOCK == 0 for n in (*offsets[-2:], *shape[-2:]))


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The weight an FP8 tensor and its block scales stand for ([..., rows, cols]), in
    `dtype`."""
    rows, cols = q.shape[-2:]
    full = scale.repeat_interleave(BLOCK, -2)[..., :rows, :].repeat_interleave(BLOCK, -1)
    return (q.float() * full[..., :cols]).to(dtype)
