"""The FP8 projection's forward on one GPU: block-scaled FP8 x FP8 (cuBLAS) against
dequantize-then-matmul and against the BF16 matmul of the same shape (the floor).

    python benchmarks/fp8_matmul.py [--tokens 1,16,256,4096]

Shapes are Qwen3-8B's projections (q/o 4096x4096, k/v 1024x4096, gate/up 12288x4096, down
4096x12288). Per shape and token count: median time of 50 calls (CUDA events), and the
relative error of each FP8 way against the exact product of the same FP8 operands in float32
(for the dequantize way that is the weight's alone; the block-scaled way also rounds the
activations to FP8 per 1 x 128 group, as vLLM's block-FP8 linear does).
"""

from __future__ import annotations

import argparse
import logging
import math
import statistics
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

from wtransfer.inference.model.fp8_matmul import block_scaled_linear, quantize_activations
from wtransfer.quant.fp8 import BLOCK, dequantize, quantize

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import print_table, write_json

SHAPES = {"q/o": (4096, 4096), "k/v": (1024, 4096), "gate/up": (12288, 4096),
          "down": (4096, 12288)}


def timed(fn: Callable[[], object], repeats: int = 50) -> float:
    """Median milliseconds of `fn()` on the current stream."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    """|out - ref| / |ref| (Frobenius)."""
    return float((out.float() - ref).norm() / ref.norm())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", default="1,16,256,4096")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA device")
    torch.manual_seed(0)
    rows = []
    for label, (out_f, in_f) in SHAPES.items():
        weight = torch.randn(out_f, in_f, device="cuda", dtype=torch.bfloat16) * 0.02
        q, scale = quantize(weight)
        w_deq = dequantize(q, scale, torch.float32)
        for tokens in (int(t) for t in args.tokens.split(",")):
            x = torch.randn(tokens, in_f, device="cuda", dtype=torch.bfloat16)
            xq, xs = quantize_activations(x)
            x_deq = (xq.float().view(-1, in_f // BLOCK, BLOCK) * xs.unsqueeze(-1)
                     ).view(-1, in_f)[:tokens]
            fast = block_scaled_linear(x, q, scale)
            dequantized = F.linear(x, dequantize(q, scale, x.dtype))
            row: dict[str, object] = {
                "shape": f"{label} {out_f}x{in_f}", "tokens": tokens,
                "bf16": timed(lambda: F.linear(x, weight)),  # noqa: B023
                "dequant": timed(lambda: F.linear(x, dequantize(q, scale, x.dtype))),  # noqa: B023
                "fp8": math.nan if fast is None else timed(
                    lambda: block_scaled_linear(x, q, scale)),  # noqa: B023
                "err_dequant": rel(dequantized, x.float() @ w_deq.t()),
                "err_fp8": math.nan if fast is None else rel(fast, x_deq @ w_deq.t()),
            }
            rows.append(row)
            print(row, flush=True)
    print_table(rows, [("shape", "shape", "s"), ("tokens", "tokens", "d"),
                       ("bf16", "bf16 ms", ".4f"), ("dequant", "dequant ms", ".4f"),
                       ("fp8", "fp8 x fp8 ms", ".4f"), ("err_dequant", "dequant err", ".1e"),
                       ("err_fp8", "fp8 err", ".1e")])
    write_json("fp8_matmul", rows, vars(args))


if __name__ == "__main__":
    main()
