"""Where a decode step's time goes: the engine serving `--inflight` greedy streams (as
`benchmarks/stall.py` drives it), then `torch.profiler` over a window of steps. Prints, per
step: the wall time between steps, the device's busy time (the sum of its kernels' durations;
copies and memsets left out), the kernels launched, and the kernels that took most of it;
beside them one read of every weight (the floor of a decode step), measured in the same
process.

    python benchmarks/decode_profile.py --device cuda --model qwen3-0.6b --inflight 16
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from wtransfer.inference import AsyncEngine, EngineConfig

sys.path.insert(0, str(Path(__file__).parent))
from stall import load, step_interval, weight_read_ms


async def main(args: argparse.Namespace) -> None:
    engine = AsyncEngine(EngineConfig(model=args.model, max_num_seqs=max(64, args.inflight),
                                      device=args.device, update_staging="off",
                                      paged_attention=not args.gather))
    floor = weight_read_ms(engine)
    stop, counted = asyncio.Event(), [0]
    driving = asyncio.create_task(load(engine, args.inflight, args.max_tokens, stop, counted))
    await asyncio.sleep(args.warmup_s)
    interval = await step_interval(engine)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA]
                                           if args.device.startswith("cuda") else [])
    with profile(activities=activities) as prof:
        first = (await engine.stats())["steps"]
        started = time.perf_counter()
        await asyncio.sleep(args.window_s)
        steps = (await engine.stats())["steps"] - first
        wall = time.perf_counter() - started
    stop.set()
    await engine.abort_requests()
    await asyncio.wait_for(driving, 120)
    engine.shutdown()
    kernels: collections.Counter[str] = collections.Counter()
    counts: collections.Counter[str] = collections.Counter()
    for event in prof.events():
        if (event.device_type == torch.autograd.DeviceType.CUDA
                and not event.name.startswith(("Memcpy", "Memset"))):
            kernels[event.name] += event.device_time
            counts[event.name] += 1
    steps = max(steps, 1)
    busy_ms = sum(kernels.values()) / 1e3 / steps
    print(f"{args.model} x{args.inflight} ({'gather' if args.gather else 'paged'}): "
          f"step {interval * 1e3:.2f} ms between steps (unprofiled), "
          f"{wall * 1e3 / steps:.2f} ms profiled over {steps} steps; device busy "
          f"{busy_ms:.2f} ms per step ({busy_ms / (wall * 1e3 / steps):.0%} of it), "
          f"{sum(counts.values()) / steps:.0f} kernels per step; one read of the weights "
          f"{floor:.2f} ms")
    print(f"{'kernel':<90} {'us/step':>9} {'n/step':>7}")
    for name, total in kernels.most_common(args.top):
        print(f"{name[:90]:<90} {total / steps:9.1f} {counts[name] / steps:7.1f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--inflight", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--warmup-s", type=float, default=3.0)
    parser.add_argument("--window-s", type=float, default=1.0)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--gather", action="store_true",
                        help="decode attention gathers its keys for SDPA (paged_attention=False)")
    asyncio.run(main(parser.parse_args()))
