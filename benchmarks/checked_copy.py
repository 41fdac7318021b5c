"""The checked copy (`wtransfer.receiver.finite_copy`) against a plain device copy of the same
bytes, in one run: one large buffer for a few block sizes and warp counts, then a model's
tensor list copied tensor by tensor, checked copies from several sizes up (the rest copied
plainly and summed the batched way, as an update does), against plain copies alone (CUDA
with Triton only).

    python benchmarks/checked_copy.py --mib 1024 --model qwen3-8b
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import triton
from common import median_seconds

from wtransfer.packing import DTYPES
from wtransfer.receiver import finite_copy
from wtransfer.receiver.finite import FiniteCheck
from wtransfer.shapes import model_metas


def _timed(fn: Callable[[], object], repeats: int) -> float:
    return median_seconds(fn, repeats, warmup=0, sync=torch.cuda.synchronize)


def main() -> None:
    """Print each variant's milliseconds and its ratio to `copy_`."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mib", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--model", default="qwen3-8b")
    args = parser.parse_args()
    _one_buffer(args.mib, args.repeats)
    _model_list(args.model, args.repeats)


def _one_buffer(mib: int, repeats: int) -> None:
    """One flat bf16 buffer: `copy_` against the kernel at a few block sizes and warps."""
    n = (mib << 20) // 2
    src = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    s16, d16 = src.view(torch.int16), dst.view(torch.int16)
    floor = _timed(lambda: dst.copy_(src), repeats)
    print(f"{mib} MiB bf16: copy_ {floor * 1e3:.3f} ms "
          f"({2 * src.nbytes / floor / 1e12:.2f} TB/s)")
    for block in (4096, 8192, 16384):
        for warps in (4, 8, 16):
            def run(block: int = block, warps: int = warps) -> None:
                finite_copy._copy_flag_kernel[(triton.cdiv(n, block),)](
                    s16, d16, n, flag, 0, MASK=0x7F80, BLOCK=block, num_warps=warps)
            run()
            t = _timed(run, repeats)
            assert torch.equal(dst.view(torch.int16), s16) and int(flag.item()) == 0
            print(f"  BLOCK {block:6d} warps {warps:2d}: {t * 1e3:.3f} ms  {t / floor:.3f}x")


def _model_list(model: str, repeats: int) -> None:
    """A model's tensors, copied one by one: plainly, then checked from each size up."""
    metas = model_metas(model)
    srcs = [torch.randn(m.numel, device="cuda").to(DTYPES[m.dtype]).view(torch.uint8)
            for m in metas]
    dsts = [torch.empty_like(s) for s in srcs]
    total = sum(s.numel() for s in srcs)

    def plain() -> None:
        for d, s in zip(dsts, srcs, strict=True):
            d.copy_(s)

    floor = _timed(plain, repeats)
    print(f"{model}: {len(metas)} tensors, {total / 1e9:.2f} GB; plain copies "
          f"{floor * 1e3:.2f} ms")
    for least in (1 << 20, 16 << 20, 64 << 20):
        def checked(least: int = least) -> None:
            check = FiniteCheck()
            copies = check.copies(torch.device("cuda", torch.cuda.current_device()),
                                  len(metas))
            assert copies is not None
            rest = []
            for m, d, s in zip(metas, dsts, srcs, strict=True):
                if s.numel() < least or not copies.add(m.name, d, s, DTYPES[m.dtype]):
                    d.copy_(s)
                    rest.append((m.name, s.view(DTYPES[m.dtype])))
            check.watch_all(rest)
            assert check.first_bad() is None

        checked()
        torch.cuda.synchronize()
        start = time.perf_counter()
        checked_s = _timed(checked, repeats)
        print(f"  checked from {least >> 20:3d} MiB up: {checked_s * 1e3:.2f} ms "
              f"({checked_s / floor:.3f}x plain copies); "
              f"{(time.perf_counter() - start) / repeats * 1e3:.2f} ms a run with the syncs")


if __name__ == "__main__":
    main()
