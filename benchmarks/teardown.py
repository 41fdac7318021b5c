"""Benchmark: how long a healthy sender's shutdown takes, and what senders in a row leave.

    python benchmarks/teardown.py --backend nccl --device cuda:0 --receiver-devices cuda:1

For `--cycles` rounds against the same receivers: trainer_init, one send_weights, shutdown.
Prints the shutdown time (median and slowest) and, after the second round and after the
last, the trainer's threads, RSS and used memory of every GPU (NCCL's own buffers included),
and each receiver's threads, RSS and CUDA bytes.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time

import torch

import wtransfer
from wtransfer.launch.models import build

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from transfer import receivers, trainer_info


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def usage(watchers: list) -> dict[str, object]:
    """Threads, RSS and CUDA memory of this process (every GPU's used bytes) and each
    receiver."""
    gpus = [t - f for f, t in (torch.cuda.mem_get_info(d)
                               for d in range(torch.cuda.device_count()))] \
        if torch.cuda.is_initialized() else []
    return {"trainer": {"threads": threading.active_count(), "rss_mb": _rss() >> 20,
                        "gpu_used_mb": [g >> 20 for g in gpus]},
            "receivers": [{"threads": s["threads"], "rss_mb": s["rss_bytes"] >> 20,
                           "cuda_mb": s["cuda_bytes"] >> 20}
                          for s in (w.status() for w in watchers)]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="nccl", choices=["ipc", "nccl", "ucx"])
    parser.add_argument("--model", default="qwen3-1.7b")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--receiver-devices", default=None)
    parser.add_argument("--bucket-mb", type=int, default=256)
    parser.add_argument("--cycles", type=int, default=20)
    args = parser.parse_args()
    devices = (args.receiver_devices or args.device).split(",")
    model = build(args.model, seed=1, device=args.device, fill="constant")
    times, snapshots = [], []
    with receivers(args.backend, args.model, devices) as client:
        watchers = list(getattr(client, "clients", [client]))
        for cycle in range(args.cycles):
            info = trainer_info(args.backend, len(devices), bucket_bytes=args.bucket_mb << 20)
            begun = time.perf_counter()
            sender = wtransfer.trainer_init(info, client=client,
                                            source=wtransfer.ModuleSource(model))
            inited = time.perf_counter()
            sender.send_weights(weight_version=f"c{cycle}")
            start = time.perf_counter()
            sender.shutdown()
            times.append(time.perf_counter() - start)
            print(f"{time.strftime('%H:%M:%S')} cycle {cycle}: init {inited - begun:.2f}s, "
                  f"send {start - inited:.3f}s, shutdown {times[-1]:.3f}s, RSS MB trainer "
                  f"{_rss() >> 20} receivers {[w.status()['rss_bytes'] >> 20 for w in watchers]}",
                  file=sys.stderr, flush=True)
            if cycle in (1, args.cycles - 1):
                snapshots.append((cycle + 1, usage(watchers)))
        same = all(w.fingerprint() == wtransfer.fingerprint(model.state_dict())
                   for w in watchers)
    print(f"backend={args.backend} model={args.model} trainer={args.device} "
          f"receivers={','.join(devices)} cycles={args.cycles}")
    print(f"shutdown of a healthy sender: median {statistics.median(times) * 1e3:.1f} ms, "
          f"slowest {max(times) * 1e3:.1f} ms")
    for after, snap in snapshots:
        print(f"after {after:2d} senders: {snap}")
    print(f"bit-exact: {same}")
    if not same:
        sys.exit("fingerprint mismatch")


if __name__ == "__main__":
    main()
