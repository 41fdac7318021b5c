"""Where one nccl `send_weights` spends its time, on both sides (two GPUs, or `--cpu`).

The trainer runs here, the receiver in a child process; both stamp the same monotonic clock
(CLOCK_MONOTONIC is system-wide), by wrapping the methods each milestone passes through: the
control calls, the receiver's parsing, every group broadcast posted and every wait on one.
Prints the median of each milestone in ms from the start of `send_weights`, over `--sends`
sends after two warm-ups, so the data movement (receiver's first post to its last broadcast
done) and the control plane around it read apart.

    python3 benchmarks/nccl_timeline.py --model qwen3-8b          # cuda:0 -> cuda:1
    python3 benchmarks/nccl_timeline.py --model qwen3-0.6b --cpu  # gloo, both on CPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from wtransfer_nccl import NCCLTrainerInitInfo
from wtransfer_nccl import group as nccl_group
from wtransfer_nccl.receiver import NCCLReceiver

import wtransfer
from wtransfer.control.rpc import ReceiverServer, RPCClient
from wtransfer.launch.models import build
from wtransfer.receiver.session import UpdateSession
from wtransfer.receiver.target import ModuleTarget

Stamps = dict[str, list[float]]


def stamp(owner: Any, name: str, record: Callable[[tuple[Any, ...], Any, float, float], None]
          ) -> None:
    """Wrap method `name` of `owner` so every call that returns reports its args, result, start
    and end times."""
    original = getattr(owner, name)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        result = original(*args, **kwargs)
        record(args, result, start, time.perf_counter())
        return result

    setattr(owner, name, wrapped)


def stamp_broadcasts(current: Stamps, cpu: bool) -> None:
    """Record every group broadcast posted and every wait on one."""
    group_cls = nccl_group.GlooGroup if cpu else nccl_group.NCCLGroup
    pending_cls = nccl_group._GlooPending if cpu else nccl_group.Pending
    stamp(group_cls, "broadcast",
          lambda _a, _r, s, e: current.setdefault("post", []).extend((s, e)))
    stamp(pending_cls, "wait",
          lambda _a, _r, s, e: current.setdefault("wait", []).extend((s, e)))


def stamp_calls(current: Stamps) -> None:
    """Record when the trainer issues each control call and when its reply is read."""
    issued: dict[int, str] = {}

    def submitted(args: tuple[Any, ...], call: Any, start: float, _end: float) -> None:
        issued[call.call_id] = str(args[1])
        current[f"{args[1]} issued"] = [start]

    def read(args: tuple[Any, ...], _result: Any, _start: float, end: float) -> None:
        client = args[0]
        for call_id in list(issued):
            if call_id in client._replies:
                current[f"{issued.pop(call_id)} answered"] = [end]

    stamp(RPCClient, "submit", submitted)
    stamp(RPCClient, "_read_replies", read)


def serve(model: str, device: str, cpu: bool) -> None:
    """The receiver child: serve until stdin closes, then print every update's stamps."""
    updates: list[Stamps] = []
    current: Stamps = {}
    stamp_broadcasts(current, cpu)

    def parsed(_args: tuple[Any, ...], request: Any, start: float, end: float) -> None:
        if request[0] == "update_weights":  # (method, args, after)
            current.clear()
            current.update(arrive=[start], parsed=[end])

    stamp(ReceiverServer, "_parse", parsed)
    def forwarded(_args: tuple[Any, ...], _result: Any, _start: float, end: float) -> None:
        if updates and "finish" in current and "replied" not in updates[-1]:
            updates[-1]["replied"] = [end]  # the first replies sent after finish ran

    stamp(ReceiverServer, "_forward", forwarded)
    stamp(UpdateSession, "announce",
          lambda _a, _r, s, e: current.update(announce=[s, e]))
    stamp(NCCLReceiver, "_receive_share",
          lambda _a, _r, s, e: current.update(share=[s, e]))
    engine = wtransfer.create_receiver("nccl", ModuleTarget(build(model, 2, device, "constant")),
                                       device=device)

    def executed(_args: tuple[Any, ...], _result: Any, start: float, end: float) -> None:
        current.update(execute=[start, end])

    def finished(_args: tuple[Any, ...], _result: Any, start: float, end: float) -> None:
        current.update(finish=[start, end])
        updates.append(dict(current))

    stamp(engine, "update_weights", executed)
    stamp(engine, "finish_weight_update", finished)
    server = ReceiverServer(engine, "tcp://127.0.0.1:0").start()
    print(json.dumps({"address": server.address}), flush=True)
    sys.stdin.read()
    print(json.dumps(updates), flush=True)


def main() -> None:
    """Run the sends and print the milestones."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-8b")
    parser.add_argument("--sends", type=int, default=8)
    parser.add_argument("--cpu", action="store_true", help="gloo, trainer and receiver on CPU")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    trainer_device, receiver_device = ("cpu", "cpu") if args.cpu else ("cuda:0", "cuda:1")
    if args.serve:
        serve(args.model, receiver_device, args.cpu)
        return
    command = [sys.executable, __file__, "--serve", "--model", args.model]
    child = subprocess.Popen(command + (["--cpu"] if args.cpu else []), stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    assert child.stdin is not None and child.stdout is not None
    address = json.loads(child.stdout.readline())["address"]
    current: Stamps = {}
    stamp_broadcasts(current, args.cpu)
    stamp_calls(current)
    model = build(args.model, 1, trainer_device, "constant")
    client = RPCClient(address, timeout_s=120)
    info = NCCLTrainerInitInfo(master_address="127.0.0.1", world_size=2, timeout_s=120)
    sends: list[Stamps] = []
    with wtransfer.trainer_init(info, client=client,
                                source=wtransfer.ModuleSource(model)) as sender:
        for _ in range(args.sends + 2):
            if not args.cpu:
                torch.cuda.synchronize()
            current.clear()
            start = time.perf_counter()
            sender.send_weights()
            current.update(send=[start, time.perf_counter()])
            sends.append(dict(current))
    child.stdin.close()
    received: list[Stamps] = json.loads(child.stdout.readline())
    child.wait(timeout=30)
    rows = [
        ("trainer: start issued", "start_weight_update issued", 0),
        ("trainer: update issued", "update_weights issued", 0),
        ("trainer: first broadcast posted", "post", 0),
        ("receiver: update_weights arrived", "arrive", 0),
        ("receiver: decoded", "parsed", 0),
        ("receiver: update call starts", "execute", 0),
        ("receiver: tensors announced (checked)", "announce", 1),
        ("receiver: share starts", "share", 0),
        ("receiver: first broadcast posted", "post", 0),
        ("trainer: last broadcast done", "wait", -1),
        ("trainer: finish issued", "finish_weight_update issued", 0),
        ("receiver: last broadcast done", "wait", -1),
        ("receiver: update call ends", "execute", 1),
        ("receiver: finish call ends", "finish", 1),
        ("receiver: replies sent after finish", "replied", 0),
        ("trainer: update answered", "update_weights answered", 0),
        ("trainer: finish answered", "finish_weight_update answered", 0),
        ("trainer: send_weights returned", "send", 1),
    ]
    pairs = list(zip(sends, received, strict=True))[2:]
    print(f"\n{args.model}, {args.sends} sends ({'gloo, CPU' if args.cpu else 'NCCL, 2 GPUs'})"
          ": median ms from the start of send_weights")
    for label, key, index in rows:  # a label names its side: "trainer: ..." / "receiver: ..."
        values = [(r if label.startswith("receiver") else s).get(key, [float("nan")])[index]
                  - s["send"][0] for s, r in pairs]
        print(f"  {label:42s} {statistics.median(values) * 1e3:8.2f}")


if __name__ == "__main__":
    main()
