"""Where an update's time goes: py-spy samples of every process while trainer ranks update our
engine, summed by function.

    python benchmarks/profile_update.py --model qwen3-8b --device cuda:0 --tp 2 --path m2n

Starts `wtransfer serve` (TP workers, staging off, rollback off) and `--ranks` trainer
processes, lets one update warm up, then records the engine's processes and the ranks with
`py-spy record --format raw` (`--py-spy`: the executable; `pip install py-spy`, or carry its
wheel to a machine without an index) for `--updates` more, and prints, per process, the
functions with the most samples of their own and the wtransfer functions with the most
samples under them. Paths: `one-sender` (rank 0 packs everything; ipc) and `m2n` (each rank
stages its own part). py-spy counts active threads only (a thread waiting in a system call,
a socket poll or a sleep, is left out), so waits show as missing samples, not as rows.
"""

from __future__ import annotations

import collections
import subprocess
import tempfile
import time
from pathlib import Path

from common import progress, tp_engine, tp_update_parser

from wtransfer.launch.trainer_ranks import TrainerRanks


def summarize(raw: Path, top: int) -> list[str]:
    """The lines of one process's summary: its top self frames and wtransfer frames."""
    own: collections.Counter[str] = collections.Counter()
    under: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames, n = stack.split(";"), int(count)
        total += n
        own[frames[-1]] += n
        for frame in set(frames):
            if "wtransfer" in frame:
                under[frame] += n
    lines = [f"  {total} samples; most of their own:"]
    lines += [f"    {n:6d} {frame[:140]}" for frame, n in own.most_common(top)]
    lines.append("  wtransfer functions, samples under them:")
    lines += [f"    {n:6d} {frame[:140]}" for frame, n in under.most_common(top)]
    return lines


def main() -> None:
    """Run, record, print."""
    parser = tp_update_parser(__doc__ or "", 10)
    parser.add_argument("--rate", type=int, default=200, help="samples per second")
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--py-spy", default="py-spy")
    args = parser.parse_args()
    server = tp_engine(args)
    out = Path(tempfile.mkdtemp(prefix="wtransfer-profile-"))
    try:
        engine = subprocess.run(["pgrep", "-f", "wtransfer serve|wtransfer.inference.tp.worker"],
                                capture_output=True, text=True, check=False).stdout.split()
        m2n = args.path == "m2n"
        with TrainerRanks(args.ranks, backend="ipc", addresses=[server.url],
                          senders=args.ranks if m2n else 1, model=f"llm:{args.model}",
                          updates=args.updates + 1, device=args.device, same_weights=True,
                          gated=True, timeout_s=600,
                          init_fields={"bucket_bytes": args.bucket_mb << 20, "m2n": m2n,
                                       "timeout_s": 600}) as ranks:
            ranks.wait_for(0, "sent", 900)
            pids = {f"engine {pid}": pid for pid in engine}
            pids.update({f"rank {r}": str(p.pid) for r, p in enumerate(ranks.procs)})
            spies = {name: subprocess.Popen(
                [args.py_spy, "record", "-p", pid, "-o", str(out / f"{pid}.txt"), "-f", "raw",
                 "-r", str(args.rate), "--nonblocking"],
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                for name, pid in pids.items()}
            time.sleep(1.0)  # (the samplers attach)
            progress(f"recording {args.updates} updates ({args.path})")
            for step in range(args.updates):
                ranks.go()
                ranks.wait_for(0, "sent", 900, count=step + 2)
            seconds = sorted(r["seconds"] for r in ranks.reports(0, "sent")[1:])
            for spy in spies.values():
                spy.send_signal(2)  # py-spy writes its file on SIGINT
            for name, spy in spies.items():
                _, err = spy.communicate(timeout=60)
                if spy.returncode not in (0, -2):
                    progress(f"py-spy on {name} failed ({spy.returncode}): {err[-300:]}")
        print(f"\n{args.model} {args.path} ranks={args.ranks} TP={args.tp} {args.device}, "
              f"{args.bucket_mb} MiB buckets: median update {seconds[len(seconds) // 2]:.4f} s")
        for name, pid in pids.items():
            raw = out / f"{pid}.txt"
            print(f"\n{name}:")
            print("\n".join(summarize(raw, args.top)) if raw.exists() else "  (no samples)")
    finally:
        server.close()


if __name__ == "__main__":
    main()
