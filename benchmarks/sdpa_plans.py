"""Benchmark: what SDPA's kernels cost a serving engine's prefill, per new shape.

    python benchmarks/sdpa_plans.py            # on a CUDA device

A prefill group's attention (16 sequences, 8 KV heads x 2 query heads each, head dim 128,
bf16, a boolean causal mask laid out as the engine lays it) for several query lengths, each
kernel SDPA may choose: its first call for a shape (a new shape is what a serving step brings
nearly every time) and the median of the next five. cuDNN's kernel builds a plan per shape;
the others do not (docs/inference.md, "How a step is computed").
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

KERNELS = {"SDPA's choice": None, "cudnn": SDPBackend.CUDNN_ATTENTION,
           "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}


def prefill_group(n: int, kv_heads: int, group: int, length: int, dim: int = 128
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Queries, keys (also the values) and mask of `n` sequences prefilling `length` tokens."""
    q = torch.randn(n, kv_heads, group * length, dim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(n, kv_heads, length, dim, device="cuda", dtype=torch.bfloat16)
    causal = torch.ones(length, length, device="cuda", dtype=torch.bool).tril()
    mask = causal[None, None, None].expand(n, 1, group, length, length).reshape(
        n, 1, group * length, length)
    return q, k, mask


def timed_ms(kernel: SDPBackend | None, q: torch.Tensor, k: torch.Tensor,
             mask: torch.Tensor) -> float:
    """One masked SDPA call through `kernel` (None: SDPA's choice), synchronized."""
    torch.cuda.synchronize()
    started = time.perf_counter()
    if kernel is None:
        F.scaled_dot_product_attention(q, k, k, attn_mask=mask)
    else:
        with sdpa_kernel([kernel]):
            F.scaled_dot_product_attention(q, k, k, attn_mask=mask)
    torch.cuda.synchronize()
    return (time.perf_counter() - started) * 1e3


def main() -> None:
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    for offset, (name, kernel) in enumerate(KERNELS.items()):
        for step in range(4):
            length = 3 + offset + 41 * step  # (each kernel meets shapes none met before)
            q, k, mask = prefill_group(16, 8, 2, length)
            try:
                first = timed_ms(kernel, q, k, mask)
                then = statistics.median(timed_ms(kernel, q, k, mask) for _ in range(5))
            except RuntimeError as exc:
                print(f"{name:14s} length {length:4d}: not available ({str(exc)[:60]})")
                continue
            print(f"{name:14s} length {length:4d}: first call {first:8.2f} ms, "
                  f"then {then:6.3f} ms")


if __name__ == "__main__":
    main()
