"""Shared helpers for the benchmark scripts: timing, tables, JSON output."""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def median_seconds(fn: Callable[[], object], repeats: int, warmup: int = 1,
                   sync: Callable[[], object] | None = None) -> float:
    """Median wall time of `fn()` over `repeats` runs after `warmup` untimed runs (with
    `sync`, such as `torch.cuda.synchronize`, called before each run and inside its time)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if sync is not None:
            sync()
        start = time.perf_counter()
        fn()
        if sync is not None:
            sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def paired(path: Callable[[], object], floor: Callable[[], object], repeats: int,
           warmup: int = 1) -> tuple[float, float]:
    """Median seconds of `path` and of `floor`, their runs interleaved (path, floor, path, ...)
    after `warmup` runs of each, so both see the same machine state (caches, clocks, page
    faults already taken, other load)."""
    for _ in range(warmup):
        path()
        floor()
    path_times: list[float] = []
    floor_times: list[float] = []
    for _ in range(repeats):
        for fn, times in ((path, path_times), (floor, floor_times)):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    return statistics.median(path_times), statistics.median(floor_times)


def print_table(rows: list[dict[str, Any]], columns: list[tuple[str, str, str]]) -> None:
    """Print `rows` as a table; each column is (key, header, format spec)."""
    widths = [max(len(h), *(len(format(r[k], f)) for r in rows)) for k, h, f in columns]
    print("  ".join(h.rjust(w) for (_, h, _), w in zip(columns, widths, strict=True)))
    for r in rows:
        print("  ".join(format(r[k], f).rjust(w)
                        for (k, _, f), w in zip(columns, widths, strict=True)))


def write_json(name: str, rows: list[dict[str, Any]], args: dict[str, Any]) -> Path:
    """Write results with the machine description to bench-results/<name>.json."""
    out = Path(os.environ.get("WTRANSFER_BENCH_DIR", "bench-results"))
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    machine = {"platform": platform.platform(), "cpus": os.cpu_count(),
               "torch": torch.__version__,
               "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
    path.write_text(json.dumps({"args": args, "machine": machine, "rows": rows}, indent=2))
    return path


def progress(message: str) -> None:
    """One timestamped line on stderr (a run cut short by its time limit shows how far it
    got)."""
    print(f"{time.strftime('%H:%M:%S')} {message}", file=sys.stderr, flush=True)


def tp_update_parser(description: str, updates: int) -> argparse.ArgumentParser:
    """The arguments of the scripts that watch trainer ranks update our TP engine
    (`profile_update.py`, `update_timeline.py`)."""
    parser = argparse.ArgumentParser(description=description,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--path", choices=["one-sender", "m2n"], default="m2n")
    parser.add_argument("--bucket-mb", type=int, default=1024)
    parser.add_argument("--updates", type=int, default=updates)
    return parser


def tp_engine(args: argparse.Namespace) -> Any:
    """`wtransfer serve` of `args.model` with `args.tp` workers on `args.device`, over ipc,
    staging and rollback off (an `HTTPPolicyServer`; close it)."""
    from wtransfer.demos.rl.servers import HTTPPolicyServer

    progress(f"starting the engine ({args.model}, TP={args.tp}, {args.device})")
    return HTTPPolicyServer(model=args.model, seed=2, backend="ipc",
                            tensor_parallel_size=args.tp, update_staging="off",
                            update_rollback="off", start_timeout_s=600, device=args.device)
