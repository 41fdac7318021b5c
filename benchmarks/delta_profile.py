"""Where a GPU delta sender's `prepare` spends its time: the whole prepare, the comparison
alone (`LastSent.changes`), the host time of each, and the device kernels by total time
(torch.profiler), at a given fraction changed, against one D2D copy of the model.

    python3 benchmarks/delta_profile.py --model qwen3-8b --fraction 0.01
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from gpu_paths import d2d_floor
from torch.profiler import ProfilerActivity, profile

from wtransfer.delta.sender import DeltaSender
from wtransfer.shapes import build_module, model_metas, perturb
from wtransfer.trainer.source import ModuleSource


def timed(fn, repeats: int) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    """Median (wall ms, host ms until the call returned) of `fn` over `repeats` runs."""
    walls, hosts = [], []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        host = time.perf_counter()
        torch.cuda.synchronize()
        walls.append((time.perf_counter() - start) * 1e3)
        hosts.append((host - start) * 1e3)
    return statistics.median(walls), statistics.median(hosts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="qwen3-8b")
    parser.add_argument("--fraction", type=float, default=0.01)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    metas = model_metas(args.model)
    model = build_module(metas, seed=1, device="cuda")
    nbytes = sum(m.nbytes for m in metas)
    copy_ms = d2d_floor(nbytes, args.repeats) * 1e3
    source = ModuleSource(model)
    sender = DeltaSender(copy_device="cuda")
    sender.landed(sender.prepare(source))
    step = [0]

    def prepare() -> None:
        step[0] += 1
        perturb(model, args.fraction, seed=step[0])
        torch.cuda.synchronize()
        begin = time.perf_counter()
        update = sender.prepare(source)
        end = time.perf_counter()
        torch.cuda.synchronize()
        prepares.append(((time.perf_counter() - begin) * 1e3, (end - begin) * 1e3))
        sender.landed(update)

    prepares: list[tuple[float, float]] = []
    for _ in range(args.repeats + 1):
        prepare()
    wall = statistics.median(p[0] for p in prepares[1:])
    host = statistics.median(p[1] for p in prepares[1:])
    print(f"{args.model}: {nbytes / 1e9:.1f} GB, {len(metas)} tensors, "
          f"{args.fraction:.2%} perturbed; one D2D copy {copy_ms:.2f} ms")
    print(f"prepare: {wall:.1f} ms ({wall / copy_ms:.2f}x the copy), host {host:.1f} ms")
    last = sender._last  # (a benchmark looks inside)
    assert last is not None
    limits = {m.name: 1 << 62 for m in metas}
    perturb(model, args.fraction, seed=1000)
    compare_ms, compare_host = timed(
        lambda: [None for _ in last.changes(source.tensors(), limits)], 1)
    print(f"compare alone (first after a perturb): {compare_ms:.1f} ms, host "
          f"{compare_host:.1f} ms")
    perturb(model, args.fraction, seed=1001)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        sender.landed(sender.prepare(source))
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18,
                                    max_name_column_width=48))


if __name__ == "__main__":
    main()
