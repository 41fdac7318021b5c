"""Decode attention that reads the paged KV cache in place: one Triton kernel per layer for the
whole batch (CUDA only; imported where Triton is). Each program takes one sequence and one KV
head, walks that sequence's block table up to its length and keeps an online softmax, so each
key and value is read once, no key is gathered into a copy, and a sequence's result does not
depend on the others in the batch. docs/inference.md says what it replaced and what it costs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

TILE = 64
"""Keys per iteration of a program."""


@triton.jit
def _paged_decode_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, lengths_ptr,  # type: ignore[no-untyped-def]
                         out_ptr, scale, q_seq, q_head, kv_slot, kv_head, table_seq,
                         out_seq, out_head,
                         GROUP: tl.constexpr, ROWS: tl.constexpr, DIM: tl.constexpr,
                         BLOCK: tl.constexpr, TILE: tl.constexpr):
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    length = tl.load(lengths_ptr + seq)
    row = tl.arange(0, ROWS)
    dim = tl.arange(0, DIM)
    head = kvh * GROUP + row
    q = tl.load(q_ptr + seq * q_seq + head[:, None] * q_head + dim[None, :],
                mask=row[:, None] < GROUP, other=0.0)
    best = tl.full([ROWS], float("-inf"), tl.float32)
    total = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, DIM], tl.float32)
    for start in range(0, length, TILE):
        key = start + tl.arange(0, TILE)
        inside = key < length
        block = tl.load(tables_ptr + seq * table_seq + key // BLOCK, mask=inside, other=0)
        slot = block.to(tl.int64) * BLOCK + key % BLOCK
        at = slot[:, None] * kv_slot + kvh * kv_head + dim[None, :]
        k = tl.load(k_ptr + at, mask=inside[:, None], other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision="ieee")  # (fp32: no TF32)
        scores = tl.where(inside[None, :], scores * scale, float("-inf"))
        new_best = tl.maximum(best, tl.max(scores, 1))
        weights = tl.exp(scores - new_best[:, None])
        fade = tl.exp(best - new_best)
        total = total * fade + tl.sum(weights, 1)
        v = tl.load(v_ptr + at, mask=inside[:, None], other=0.0)
        acc = acc * fade[:, None] + tl.dot(weights.to(v.dtype), v, input_precision="ieee")
        best = new_best
    out = acc / total[:, None]
    tl.store(out_ptr + seq * out_seq + head[:, None] * out_head + dim[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row[:, None] < GROUP)


def supports(dim: int, dtype: torch.dtype) -> bool:
    """Whether the kernel takes heads of `dim` values in `dtype`."""
    return (16 <= dim <= 256 and dim & (dim - 1) == 0
            and dtype in (torch.bfloat16, torch.float16, torch.float32))


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 tables: torch.Tensor, lengths: torch.Tensor, block_size: int) -> torch.Tensor:
    """Attention of one new query per sequence, q [B, heads, D], to the first `lengths[b]`
    keys of sequence b, whose cache slots are `tables[b, t // block_size] * block_size +
    t % block_size` in k_cache and v_cache [slots, kv_heads, D]; scaled by 1/sqrt(D). Returns
    [B, heads, D] in q's dtype. Every length must be at least 1 (`supports` says which D)."""
    batch, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    group = heads // kv_heads
    out = torch.empty_like(q)
    if (k_cache.stride(2) != 1 or v_cache.stride() != k_cache.stride() or q.stride(2) != 1
            or tables.stride(1) != 1 or lengths.stride(0) != 1):
        raise ValueError("paged_decode needs the last dimension of q, the caches and the "
                         "tables dense, and both caches laid out alike")
    if k_cache.shape[2] != dim or v_cache.shape != k_cache.shape or heads % kv_heads:
        raise ValueError(f"paged_decode: queries of {heads} heads of {dim} do not fit caches "
                         f"of shape {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    rows = max(16, triton.next_power_of_2(group))
    with torch.cuda.device(q.device):  # (the calling thread's may be another)
        _paged_decode_kernel[(batch, kv_heads)](
            q, k_cache, v_cache, tables, lengths, out, dim ** -0.5,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), tables.stride(0),
            out.stride(0), out.stride(1),
            GROUP=group, ROWS=rows, DIM=dim, BLOCK=block_size, TILE=TILE,
            num_warps=4)
    return out
