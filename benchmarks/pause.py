"""Benchmark: pause/resume latency per mode against the number of in-flight requests, decode
throughput, and the data-parallel pause, on the tiny model (CPU).

    python benchmarks/pause.py --inflight 1,16,64,256 --dp-sizes 1,2,4 --dp-intervals 1,8,32

A keep or abort pause is handled between two engine steps, so its latency is compared with the
median step time measured in the same run ("steps" column). A wait pause lasts until running
requests finish (max_tokens=16 here), so it is reported for completeness, not as a latency.

Data-parallel rows: N rank processes in lockstep, 4 requests per rank kept running; a keep pause
holds once a state sync (every dp_sync_interval steps) finds every rank paused, so its latency
is compared with that interval's worth of lockstep steps. "idle" pauses an engine with nothing
running: the ranks start a wave only to agree on the pause.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from wtransfer.inference import AsyncEngine, EngineConfig, SamplingParams
from wtransfer.records import check_pause_mode

sys.path.insert(0, str(Path(__file__).parent))
from common import print_table, write_json


async def drive(engine: AsyncEngine, n: int, max_tokens: int) -> tuple[list[asyncio.Task[Any]],
                                                                       dict[str, int]]:
    progress: dict[str, int] = {}
    params = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=1)

    async def one(i: int) -> None:
        async for out in engine.generate([i % 200 + 1, 7, 9, 11], params, request_id=f"q{i}"):
            progress[f"q{i}"] = len(out.outputs[0].token_ids)

    tasks = [asyncio.create_task(one(i)) for i in range(n)]
    while len(progress) < n:
        await asyncio.sleep(0.0005)
    return tasks, progress


async def measure(n: int, mode: str) -> dict[str, Any]:
    engine = AsyncEngine(EngineConfig(model="tiny", max_num_seqs=256, num_kv_blocks=4096))
    max_tokens = 16 if mode == "wait" else 400
    tasks, _ = await drive(engine, n, max_tokens)
    step_s = await step_seconds(engine)
    start = time.perf_counter()
    await engine.pause_generation(mode=check_pause_mode(mode), clear_cache=False)
    pause_s = time.perf_counter() - start
    start = time.perf_counter()
    await engine.resume_generation()
    resume_s = time.perf_counter() - start
    await engine.abort_requests()
    await asyncio.gather(*tasks)
    engine.shutdown()
    return {"inflight": n, "mode": mode, "pause_ms": pause_s * 1e3, "resume_ms": resume_s * 1e3,
            "step_ms": step_s * 1e3, "steps": pause_s / step_s}


async def step_seconds(engine: AsyncEngine, steps: int = 4) -> float:
    """Seconds per engine step (per lockstep step with data parallelism) while busy."""
    async def count() -> int:
        stats = await engine.stats()
        return int(stats["ranks"][0]["steps"] + stats["ranks"][0]["dummy_steps"]
                   if "ranks" in stats else stats["steps"])

    before, t_before = await count(), time.perf_counter()
    while (now := await count()) < before + steps:
        await asyncio.sleep(0.0005)
    return (time.perf_counter() - t_before) / (now - before)


async def measure_dp(size: int, interval: int, repeats: int) -> dict[str, Any]:
    """Median keep-pause, resume and idle-pause latency of a data-parallel engine."""
    engine = AsyncEngine(EngineConfig(model="tiny", data_parallel_size=size,
                                      dp_sync_interval=interval, max_num_seqs=64))
    idle = []
    for _ in range(repeats):
        start = time.perf_counter()
        await engine.pause_generation(mode="keep", clear_cache=False)
        idle.append(time.perf_counter() - start)
        await engine.resume_generation()
    tasks, _ = await drive(engine, 4 * size, 1500)
    step_s = await step_seconds(engine)
    pauses, resumes = [], []
    for _ in range(repeats):
        await asyncio.sleep(0.02)
        start = time.perf_counter()
        await engine.pause_generation(mode="keep", clear_cache=False)
        pauses.append(time.perf_counter() - start)
        start = time.perf_counter()
        await engine.resume_generation()
        resumes.append(time.perf_counter() - start)
    await engine.abort_requests()
    await asyncio.gather(*tasks)
    engine.shutdown()
    pause_s = statistics.median(pauses)
    return {"dp": size, "interval": interval if size > 1 else "-", "pause_ms": pause_s * 1e3,
            "worst_pause_ms": max(pauses) * 1e3, "idle_pause_ms": statistics.median(idle) * 1e3,
            "resume_ms": statistics.median(resumes) * 1e3, "step_ms": step_s * 1e3,
            "steps": pause_s / step_s}


async def throughput(n: int, tokens: int) -> dict[str, Any]:
    engine = AsyncEngine(EngineConfig(model="tiny", max_num_seqs=256, num_kv_blocks=4096))
    start = time.perf_counter()
    tasks, _ = await drive(engine, n, tokens)
    await asyncio.gather(*tasks)
    seconds = time.perf_counter() - start
    engine.shutdown()
    return {"requests": n, "tokens": n * tokens, "seconds": seconds,
            "tokens_per_s": n * tokens / seconds}


async def main_async(args: argparse.Namespace) -> None:
    rows = []
    for n in [int(x) for x in args.inflight.split(",")]:
        for mode in ("keep", "abort", "wait"):
            runs = [await measure(n, mode) for _ in range(args.repeats)]
            row = dict(runs[0])
            for key in ("pause_ms", "resume_ms", "step_ms", "steps"):
                row[key] = statistics.median(r[key] for r in runs)
            rows.append(row)
    print(f"\npause/resume latency, tiny model, CPU (median of {args.repeats})")
    print_table(rows, [("inflight", "in-flight", "d"), ("mode", "mode", ""),
                       ("pause_ms", "pause ms", ".2f"), ("resume_ms", "resume ms", ".2f"),
                       ("step_ms", "step ms", ".2f"), ("steps", "steps", ".2f")])
    tput = [await throughput(n, 64) for n in (1, 16, 64)]
    print("\ndecode throughput, tiny model, CPU")
    print_table(tput, [("requests", "requests", "d"), ("tokens", "tokens", "d"),
                       ("seconds", "seconds", ".2f"), ("tokens_per_s", "tokens/s", ".0f")])
    dp_rows = []
    for size in [int(x) for x in args.dp_sizes.split(",")]:
        intervals = [int(x) for x in args.dp_intervals.split(",")] if size > 1 else [1]
        for interval in intervals:
            dp_rows.append(await measure_dp(size, interval, args.repeats * 3))
    print(f"\ndata-parallel keep pause, tiny model, CPU, 4 requests per rank "
          f"(median of {args.repeats * 3})")
    print_table(dp_rows, [("dp", "ranks", "d"), ("interval", "sync every", ""),
                          ("pause_ms", "pause ms", ".2f"), ("worst_pause_ms", "worst ms", ".2f"),
                          ("idle_pause_ms", "idle pause ms", ".2f"),
                          ("resume_ms", "resume ms", ".2f"), ("step_ms", "step ms", ".2f"),
                          ("steps", "steps", ".1f")])
    print(f"wrote {write_json('pause', rows + tput + dp_rows, vars(args))}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--inflight", default="1,16,64,256")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dp-sizes", default="1,2,4")
    parser.add_argument("--dp-intervals", default="1,8,32")
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
