"""Shared helpers for the benchmark scripts: timing, tables, JSON output."""

from __future__ import annotations

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
