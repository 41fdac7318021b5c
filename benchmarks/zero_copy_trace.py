"""Where a zero-copy ipc update's time goes: a timeline of both processes, per update.

    python benchmarks/zero_copy_trace.py --model qwen3-8b --device cuda:0 --updates 12

The trainer (this process) sends `--updates` zero-copy updates to a receiver child built as
`wtransfer.launch.peer` builds one. Both processes mark the moments that matter (a call
submitted, parsed by the server, begun and ended on the engine, its reply sent and read;
the source checks, the copies issued, the drain) on the system-wide monotonic clock, so the
marks of the two processes share one time axis. The child also times its copies on the GPU
(CUDA events around them). Printed: each mark's median offset from `send_weights`' start
over the kept updates, then the floors of the same run (one flat copy of every byte; the
same tensors copied one by one in this process).

Tracing wraps the library's functions from outside (this script only); it adds about a
microsecond per mark.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import median_seconds, progress

MARKS: list[tuple[str, int]] = []


def mark(name: str) -> None:
    """Note `name` at the system-wide monotonic clock."""
    MARKS.append((name, time.monotonic_ns()))


def wrap(owner: Any, attr: str, label: str, result_label: Any = None) -> None:
    """Mark `label>` before and `label<` after every call of `owner.attr`."""
    original = getattr(owner, attr)

    @functools.wraps(original)
    def traced(*args: Any, **kwargs: Any) -> Any:
        mark(label + ">")
        out = original(*args, **kwargs)
        mark((result_label(out) if result_label else label) + "<")
        return out

    setattr(owner, attr, traced)


def trace_receiver(path: str) -> None:
    """Wrap the receiver's path; write every mark to `path` when the parent goes."""
    import wtransfer_ipc.receiver as ipc_receiver
    from wtransfer_ipc.zero_copy import ZeroCopyImports

    import wtransfer.receiver.engine as engine_module
    from wtransfer.control.rpc import ReceiverServer
    from wtransfer.launch import peer
    from wtransfer.manifest import Manifests
    from wtransfer.receiver.engine import WeightTransferEngine
    from wtransfer.receiver.session import UpdateSession
    from wtransfer.receiver.target import ModuleTarget

    wrap(ReceiverServer, "_parse", "parse", lambda out: f"parsed {out[0]}")
    for owner, attr, label in (
            (ReceiverServer, "_send", "send reply"),
            (WeightTransferEngine, "start_weight_update", "start"),
            (WeightTransferEngine, "update_weights", "update"),
            (UpdateSession, "precheck", "precheck"), (UpdateSession, "announce", "announce"),
            (engine_module, "parse_record", "parse_record"), (Manifests, "resolve", "resolve"),
            (ZeroCopyImports, "sources", "sources"), (ipc_receiver, "drain", "drain"),
            (ModuleTarget, "finish", "target finish")):
        wrap(owner, attr, label)
    gpu: list[torch.cuda.Event] = []
    load_whole = UpdateSession.load_whole

    def timed_load(self: UpdateSession, sources: Any) -> None:
        gpu[:] = [torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)]
        gpu[0].record()
        mark("copies>")
        load_whole(self, sources)
        mark("copies<")
        gpu[1].record()

    UpdateSession.load_whole = timed_load  # type: ignore[method-assign]
    wrap(WeightTransferEngine, "finish_weight_update", "finish")
    copies: list[list[torch.cuda.Event]] = []
    finish = WeightTransferEngine.finish_weight_update

    def finish_and_keep(self: WeightTransferEngine[Any, Any], *args: Any, **kw: Any) -> None:
        finish(self, *args, **kw)
        copies.append(list(gpu))

    WeightTransferEngine.finish_weight_update = finish_and_keep  # type: ignore[method-assign]

    def dump() -> None:
        gpu_ms = [pair[0].elapsed_time(pair[1]) for pair in copies if pair]
        Path(path).write_text(json.dumps({"marks": MARKS, "gpu_copies_ms": gpu_ms}))

    def exit_when_parent_goes() -> None:  # the marks are written once, at exit
        def watch() -> None:
            sys.stdin.read()
            dump()
            os._exit(0)

        threading.Thread(target=watch, daemon=True).start()

    peer._exit_when_parent_goes = exit_when_parent_goes


def trace_trainer() -> None:
    """Wrap the trainer's path (call ids are named by method as they are submitted)."""
    import wtransfer_ipc.zero_copy as zero_copy
    from wtransfer_ipc.zero_copy import ZeroCopyExports

    from wtransfer.control.rpc import RPCClient
    from wtransfer.trainer.engine import Share, TrainerTransferEngine
    from wtransfer.trainer.plans import SenderPlans
    from wtransfer.trainer.source import ModuleSource

    for owner, attr, label in (
            (TrainerTransferEngine, "send_weights", "send_weights"),
            (SenderPlans, "of", "layout"),
            (Share, "in_place", "in_place"), (ZeroCopyExports, "update", "exports"),
            (zero_copy, "record_to_wire", "to_wire"), (ModuleSource, "metadata", "metadata")):
        wrap(owner, attr, label)
    names: dict[int, str] = {}
    submit, read = RPCClient.submit, RPCClient._read_replies

    def traced_submit(self: RPCClient, method: str, **kw: Any) -> Any:
        call = submit(self, method, **kw)
        names[call.call_id] = method
        mark(f"sent {method}")
        return call

    def traced_read(self: RPCClient) -> None:
        before = set(self._replies)
        read(self)
        for call_id in set(self._replies) - before:
            mark(f"reply {names.get(call_id, '?')}")

    RPCClient.submit = traced_submit  # type: ignore[method-assign]
    RPCClient._read_replies = traced_read  # type: ignore[method-assign]


def run_child(args: argparse.Namespace) -> None:
    """The receiver: `wtransfer.launch.peer`'s, traced."""
    from wtransfer.launch import peer

    trace_receiver(args.trace)
    peer.main(["receiver", "--backend", "ipc", "--model", args.model, "--seed", "2",
               "--device", args.device, "--fill", "constant"])


def summarize(updates: list[list[tuple[str, int]]]) -> list[tuple[str, float]]:
    """Each mark's median offset (ms) from the update's `send_weights>`; marks that occur
    several times in an update are numbered."""
    offsets: dict[str, list[float]] = {}
    for marks in updates:
        origin = next(t for name, t in marks if name == "send_weights>")
        seen: dict[str, int] = {}
        for name, t in marks:
            seen[name] = seen.get(name, 0) + 1
            key = name if seen[name] == 1 else f"{name} #{seen[name]}"
            offsets.setdefault(key, []).append((t - origin) / 1e6)
    rows = [(k, statistics.median(v)) for k, v in offsets.items() if len(v) == len(updates)]
    return sorted(rows, key=lambda row: row[1])


def main() -> None:
    """Trace the updates, then print the timeline and the floors."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="qwen3-8b")
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--updates", type=int, default=12)
    parser.add_argument("--keep", type=int, default=8, help="the last N updates summarized")
    parser.add_argument("--child-trace", dest="trace", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trace:
        run_child(args)
        return
    from wtransfer_ipc import IPCTrainerInitInfo

    import wtransfer
    from wtransfer.control.rpc import RPCClient
    from wtransfer.copies import CopyQueue, copy_bytes
    from wtransfer.launch.models import build
    from wtransfer.packing import byte_view

    trace = Path(tempfile.mkdtemp()) / "receiver.json"
    child = subprocess.Popen([sys.executable, __file__, "--model", args.model, "--device",
                              args.device, "--child-trace", str(trace)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        progress(f"building {args.model} on {args.device}")
        model = build(args.model, seed=1, device=args.device, fill="constant")
        address = json.loads(child.stdout.readline())["address"]
        trace_trainer()
        client = RPCClient(address, timeout_s=600)
        info = IPCTrainerInitInfo(timeout_s=600)
        trainer: list[list[tuple[str, int]]] = []
        seconds = []
        with wtransfer.trainer_init(info, client=client,
                                    source=wtransfer.ModuleSource(model)) as sender:
            for _ in range(args.updates):
                MARKS.clear()
                start = time.perf_counter()
                sender.send_weights()
                seconds.append(time.perf_counter() - start)
                trainer.append(list(MARKS))
        same = client.fingerprint() == wtransfer.fingerprint(model.state_dict())
        client.close()
    finally:
        if child.stdin is not None:
            child.stdin.close()
        child.wait(timeout=60)
    receiver = json.loads(trace.read_text())
    keep = slice(len(trainer) - args.keep, None)
    merged = []
    for marks in trainer[keep]:  # each update: the receiver's marks within its send_weights
        begin, end = marks[0][1], marks[-1][1]
        merged.append(sorted(marks + [(n, t) for n, t in receiver["marks"]
                                      if begin <= t <= end], key=lambda m: m[1]))
    print(f"{args.model}: {len(merged)} updates kept of {len(trainer)}, weights same: {same}")
    print(f"send_weights median {statistics.median(seconds[keep]) * 1e3:.2f} ms, "
          f"GPU time of the receiver's copies median "
          f"{statistics.median(receiver['gpu_copies_ms'][keep] or [float('nan')]):.2f} ms")
    print(f"{'mark (median over the kept updates)':<40} {'ms from send_weights>':>22}")
    for name, ms in summarize(merged):
        print(f"{name:<40} {ms:>22.3f}")
    print("the last update, every mark:")
    origin = merged[-1][0][1]
    print("  ".join(f"{name} {(t - origin) / 1e6:.3f}" for name, t in merged[-1]))
    tensors = [byte_view(t) for t in model.state_dict().values()]
    flat = torch.cat(tensors)
    other = torch.empty_like(flat)
    dest = [torch.empty_like(t) for t in tensors]

    def sync() -> None:
        if flat.is_cuda:
            torch.cuda.synchronize()

    def one_copy() -> None:
        other.copy_(flat)
        sync()

    def tensor_copies() -> None:
        copy_bytes(dest, tensors)
        sync()

    def one_stream() -> None:
        for d, s in zip(dest, tensors, strict=True):
            d.copy_(s, non_blocking=True)
        sync()

    def queued(streams: int) -> None:
        copies = CopyQueue(streams=streams)
        for d, s in zip(dest, tensors, strict=True):
            copies.add(d, s)
        copies.close()
        sync()

    def one_launch() -> None:
        torch._foreach_copy_(dest, tensors, non_blocking=True)
        sync()

    floors: dict[str, Callable[[], None]] = {"one flat copy": one_copy, "copy_bytes": tensor_copies,
              **{f"CopyQueue as a receiver fills it, {n} streams":
                 functools.partial(queued, n) for n in (2, 3, 4)},
              "one by one on one stream": one_stream, "one multi-tensor launch": one_launch}
    print(f"floors in this process, {len(tensors)} tensors (ms): " + "; ".join(
        f"{name} {median_seconds(run, 7) * 1e3:.2f}" for name, run in floors.items()))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
