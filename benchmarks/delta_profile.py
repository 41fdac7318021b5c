"""Where a GPU delta sender's `prepare` spends its time: its wall and host time at each
fraction changed, against one D2D copy of the model, and the device kernels of one prepare by
total time (torch.profiler). ``WTRANSFER_DELTA_TRITON=0`` runs the eager comparison.

    python3 benchmarks/delta_profile.py --model qwen3-8b --fractions 0.0003,0.01
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import time

import torch
from gpu_paths import d2d_floor
from torch.profiler import ProfilerActivity, profile

from wtransfer.shapes import build_module, model_metas, perturb
from wtransfer.trainer.deltas import DeltaSender
from wtransfer.trainer.source import ModuleSource


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="qwen3-8b")
    parser.add_argument("--fractions", default="0.0003,0.01")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--python", action="store_true",
                        help="also the host's Python functions of one prepare (cProfile)")
    args = parser.parse_args()
    metas = model_metas(args.model)
    model = build_module(metas, seed=1, device="cuda")
    nbytes = sum(m.nbytes for m in metas)
    copy_ms = d2d_floor(nbytes, args.repeats) * 1e3
    source = ModuleSource(model)
    sender = DeltaSender(copy_device="cuda")
    sender.landed(sender.prepare(source))
    print(f"{args.model}: {nbytes / 1e9:.1f} GB, {len(metas)} tensors; one D2D copy "
          f"{copy_ms:.2f} ms; Triton comparison "
          f"{os.environ.get('WTRANSFER_DELTA_TRITON', '1') != '0'}")
    step = 0
    for fraction in (float(f) for f in args.fractions.split(",")):
        prepares: list[tuple[float, float]] = []
        for _ in range(args.repeats + 1):
            step += 1
            perturb(model, fraction, seed=step)
            torch.cuda.synchronize()
            begin = time.perf_counter()
            update = sender.prepare(source)
            end = time.perf_counter()
            torch.cuda.synchronize()
            prepares.append(((time.perf_counter() - begin) * 1e3, (end - begin) * 1e3))
            sender.landed(update)
        wall = statistics.median(p[0] for p in prepares[1:])
        host = statistics.median(p[1] for p in prepares[1:])
        print(f"{fraction:.2%} perturbed: prepare {wall:.1f} ms ({wall / copy_ms:.2f}x the "
              f"copy; median of {args.repeats}), host until it returned {host:.1f} ms")
    perturb(model, fraction, seed=step + 1)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        sender.landed(sender.prepare(source))
        torch.cuda.synchronize()
    if args.python:
        perturb(model, fraction, seed=step + 2)
        torch.cuda.synchronize()
        python = cProfile.Profile()
        python.enable()
        sender.landed(sender.prepare(source))
        torch.cuda.synchronize()
        python.disable()
        pstats.Stats(python).sort_stats("tottime").print_stats(25)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18,
                                    max_name_column_width=48))


if __name__ == "__main__":
    main()
