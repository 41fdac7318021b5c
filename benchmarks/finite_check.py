"""What refusing non-finite updates costs: one in-process ipc update with the receiver's
check on (the default; also with the checked copies from 64 MiB up only, and with none, every
tensor summed after its copy) and off (`allow_non_finite=True`), interleaved, beside the check alone
(the receiver's sums of |x|, every tensor in one call) and one flat copy of every byte (the
floor), in one run.

    python benchmarks/finite_check.py --model qwen3-0.6b --repeats 5
    python benchmarks/finite_check.py --model qwen3-8b --device cuda:0 --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace
from typing import Any

import torch
from common import print_table, progress, write_json
from wtransfer_ipc import IPCTrainerInitInfo

import wtransfer
from wtransfer.receiver import finite
from wtransfer.receiver.finite import FiniteCheck
from wtransfer.shapes import build_module, model_metas


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Any, device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def main() -> None:
    """Run the comparison and print the table (JSON in bench-results/finite_check.json)."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--bucket-mb", type=int, default=0,
                        help="0: the backend's default (zero-copy on CUDA, packed on the host)")
    args = parser.parse_args()
    device = torch.device(args.device)
    metas = model_metas(args.model)
    progress(f"building {args.model} twice on {device}")
    trainer = build_module(metas, 1, args.device)
    engine = build_module(metas, 2, args.device)
    receiver = wtransfer.create_receiver("ipc", wtransfer.ModuleTarget(engine),
                                        device=args.device)
    client = wtransfer.LocalClient(receiver)
    fields: dict[str, Any] = {"timeout_s": 300}
    if args.bucket_mb:
        fields["bucket_bytes"] = args.bucket_mb << 20
    sender = wtransfer.trainer_init(IPCTrainerInitInfo(**fields), client=client,
                                    source=wtransfer.ModuleSource(trainer))

    def send(check: bool, checked_from: int = finite.CHECKED_COPY_MIN_BYTES) -> None:
        """One update, the receiver checking or not (its init info's `allow_non_finite` set
        in place: one receiver, one sender, so both ways see the same memory); copies of
        `checked_from` bytes and more check as they copy where the device can."""
        assert receiver.init_info is not None
        receiver.init_info = replace(receiver.init_info, allow_non_finite=not check)
        finite.CHECKED_COPY_MIN_BYTES = checked_from
        try:
            sender.send_weights()
        finally:
            finite.CHECKED_COPY_MIN_BYTES = default_from

    default_from = finite.CHECKED_COPY_MIN_BYTES
    tensors = [t for t in trainer.state_dict().values()]
    total = sum(t.numel() * t.element_size() for t in tensors)
    flat_src = torch.empty(total, dtype=torch.uint8, device=device)
    flat_dst = torch.empty_like(flat_src)

    def check_alone() -> None:
        finite = FiniteCheck()  # every tensor in one call, as a receiver hands over an update
        finite.watch_all([(str(i), t) for i, t in enumerate(tensors)])
        assert finite.first_bad() is None

    runs = {"check on": lambda: send(True),
            "check on, checked copies from 64 MiB": lambda: send(True, 64 << 20),
            "check on, sums only": lambda: send(True, 1 << 62),
            "check off": lambda: send(False),
            "check alone": check_alone, "one copy": lambda: flat_dst.copy_(flat_src)}
    times: dict[str, list[float]] = {name: [] for name in runs}
    for fn in runs.values():  # warm-up (a sender's first update is a full one)
        _timed(fn, device)
    for repeat in range(args.repeats):
        for name, fn in runs.items():
            times[name].append(_timed(fn, device))
        progress(f"repeat {repeat + 1}/{args.repeats}")
    sender.shutdown()
    receiver.shutdown()
    floor = statistics.median(times["one copy"])
    rows = [{"path": name, "ms": statistics.median(t) * 1e3,
             "vs_floor": statistics.median(t) / floor} for name, t in times.items()]
    off = statistics.median(times["check off"])
    print(f"{args.model} on {device} ({total / 1e9:.2f} GB), median of {args.repeats}; "
          f"the check adds {(statistics.median(times['check on']) - off) * 1e3:.2f} ms "
          f"({statistics.median(times['check on']) / off:.3f}x an update without it)")
    print_table(rows, [("path", "path", "s"), ("ms", "ms", ".2f"),
                       ("vs_floor", "x one copy", ".2f")])
    write_json("finite_check", rows, vars(args))


if __name__ == "__main__":
    main()
