"""Where an update into our TP engine waits: one timeline of every process, per update.

    python benchmarks/update_timeline.py --model qwen3-8b --device cuda:0 --tp 2 --path m2n

Starts `wtransfer serve` (TP workers, staging off, rollback off) and `--ranks` trainer
processes as `benchmarks/profile_update.py` does, with `timeline_hook/` on every process's
`PYTHONPATH`: each process marks the calls that matter (a rank's send, its packing, its
waits for a free staging slot, its HTTP calls; the engine's HTTP handler, its engine thread's
commands, its calls to the workers and its waits for them; every rank's receive and copies)
on the system-wide monotonic clock, so every mark shares one time axis. One update warms up,
then `--updates` more are kept. Printed: per process and call, the median time inside it per
update and how often it ran; then the last update's every mark, in order, from rank 0's send.
"""

from __future__ import annotations

import collections
import os
import statistics
import tempfile
from pathlib import Path

from common import progress, tp_engine, tp_update_parser

Mark = tuple[int, str, str, str]  # (ns, role, thread, label)


def read_marks(folder: Path) -> list[Mark]:
    """Every process's marks, in time order."""
    marks = []
    for path in folder.glob("*.tsv"):
        for line in path.read_text().splitlines():
            role, thread, label, ns = line.split("\t")
            marks.append((int(ns), role, thread, label))
    return sorted(marks)


def updates_of(marks: list[Mark]) -> list[tuple[int, int]]:
    """Rank 0's `send` windows (start, end)."""
    starts = [ns for ns, role, _, label in marks if role == "rank0" and label == "send>"]
    ends = [ns for ns, role, _, label in marks if role == "rank0" and label == "send<"]
    return list(zip(starts, ends, strict=False))


def time_inside(marks: list[Mark], begin: int, end: int
                ) -> dict[tuple[str, str], tuple[float, int]]:
    """Per (role, call): milliseconds inside it within [begin, end] and how many calls."""
    open_at: dict[tuple[str, str, str], int] = {}
    out: dict[tuple[str, str], tuple[float, int]] = {}
    for ns, role, thread, label in marks:
        name, edge = label[:-1], label[-1]
        key = (role, thread, name)
        if edge == ">":
            open_at[key] = ns
        elif key in open_at:
            start = open_at.pop(key)
            if start >= begin and ns <= end:
                total, count = out.get((role, name), (0.0, 0))
                out[(role, name)] = (total + (ns - start) / 1e6, count + 1)
    return out


def main() -> None:
    """Run, collect, print."""
    parser = tp_update_parser(__doc__ or "", 5)
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="wtransfer-timeline-"))
    os.environ["WTRANSFER_TIMELINE"] = str(folder)
    hook = str(Path(__file__).parent / "timeline_hook")
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (hook, os.environ.get("PYTHONPATH", "")) if p)
    from wtransfer.launch.trainer_ranks import TrainerRanks

    server = tp_engine(args)
    try:
        m2n = args.path == "m2n"
        progress(f"{args.ranks} trainer ranks, {args.updates} + 1 updates ({args.path})")
        with TrainerRanks(args.ranks, backend="ipc", addresses=[server.url],
                          senders=args.ranks if m2n else 1, model=f"llm:{args.model}",
                          updates=args.updates + 1, device=args.device, same_weights=True,
                          timeout_s=600,
                          init_fields={"bucket_bytes": args.bucket_mb << 20, "m2n": m2n,
                                       "timeout_s": 600}) as ranks:
            ranks.wait_for(0, "sent", 1800, count=args.updates + 1)
            seconds = sorted(r["seconds"] for r in ranks.reports(0, "sent")[1:])
    finally:
        server.close()
    marks = read_marks(folder)
    windows = updates_of(marks)[1:]
    print(f"\n{args.model} {args.path} ranks={args.ranks} TP={args.tp} {args.device}, "
          f"{args.bucket_mb} MiB buckets: median update {statistics.median(seconds):.4f} s "
          f"({len(windows)} kept)")
    per: dict[tuple[str, str], list[tuple[float, int]]] = collections.defaultdict(list)
    for begin, end in windows:
        for key, value in time_inside(marks, begin, end).items():
            per[key].append(value)
    print(f"{'process':<10} {'call':<34} {'ms per update':>14} {'calls':>6}")
    for (role, name), values in sorted(per.items()):
        ms = statistics.median(v[0] for v in values)
        calls = statistics.median(v[1] for v in values)
        print(f"{role:<10} {name:<34} {ms:>14.2f} {calls:>6g}")
    begin, end = windows[-1]
    print("\nthe last update, every mark (ms from rank 0's send):")
    for ns, role, thread, label in marks:
        if begin <= ns <= end:
            print(f"{(ns - begin) / 1e6:9.3f}  {role:<8} {thread[:24]:<24} {label}")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
