"""Benchmark: pause/resume latency per mode against the number of in-flight requests, and
decode throughput, on the tiny model (CPU).

    python benchmarks/pause.py --inflight 1,16,64,256

A keep or abort pause is handled between two engine steps, so its latency is compared with the
median step time measured in the same run ("steps" column). A wait pause lasts until running
requests finish (max_tokens=16 here), so it is reported for completeness, not as a latency.
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
    steps_before, t_before = engine.core.steps, time.perf_counter()
    while engine.core.steps < steps_before + 4:
        await asyncio.sleep(0.0005)
    step_s = (time.perf_counter() - t_before) / (engine.core.steps - steps_before)
    start = time.perf_counter()
    await engine.pause_generation(mode=mode, clear_cache=False)
    pause_s = time.perf_counter() - start
    start = time.perf_counter()
    await engine.resume_generation()
    resume_s = time.perf_counter() - start
    await engine.abort_requests()
    await asyncio.gather(*tasks)
    engine.shutdown()
    return {"inflight": n, "mode": mode, "pause_ms": pause_s * 1e3, "resume_ms": resume_s * 1e3,
            "step_ms": step_s * 1e3, "steps": pause_s / step_s}


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
    print(f"wrote {write_json('pause', rows + tput, vars(args))}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--inflight", default="1,16,64,256")
    parser.add_argument("--repeats", type=int, default=3)
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
