"""Child-process entry points: a receiver served over RPC, or a trainer that sends.

    python -m wtransfer.launch.peer receiver --backend ipc --model mixed --seed 2
    python -m wtransfer.launch.peer trainer --backend ipc --address tcp://... --loop

The first stdout line is a JSON object (the receiver's address, or "sending"); the process
exits when its stdin closes, so a dead parent never leaves it behind.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from typing import Any

from wtransfer import wire
from wtransfer.control.rpc import ReceiverServer, RPCClient
from wtransfer.launch.models import build
from wtransfer.receiver.target import ModuleTarget
from wtransfer.registry import create_receiver, get_backend, trainer_init
from wtransfer.shapes import randomize
from wtransfer.trainer.source import ModuleSource


def _announce(payload: dict[str, Any]) -> None:
    print(json.dumps(payload), flush=True)


def _exit_when_parent_goes() -> None:
    def watch() -> None:
        sys.stdin.read()
        os._exit(0)

    threading.Thread(target=watch, daemon=True).start()


def _keep_busy(device: str) -> None:
    """Keep `device`'s default stream busy with back-to-back kernels (a few queued at any
    time), as an engine generating tokens would: work the receiver queues there runs late.
    Stops when the stream stays blocked for a minute (work queued behind an event that never
    completes), rather than waiting on it forever."""
    import torch

    def spin() -> None:
        queued: list[torch.cuda.Event] = []
        with torch.cuda.device(device):
            while True:
                torch.cuda._sleep(20_000_000)  # ~10 ms on current GPUs
                queued.append(torch.cuda.Event())
                queued[-1].record()
                if len(queued) > 3:
                    oldest, deadline = queued.pop(0), time.monotonic() + 60
                    while not oldest.query():
                        if time.monotonic() > deadline:
                            return
                        time.sleep(0.001)

    threading.Thread(target=spin, name="wtransfer-gpu-busy", daemon=True).start()


def run_receiver(args: argparse.Namespace) -> None:
    """Serve a receiver for model `args.model` until stdin closes."""
    module = build(args.model, args.seed, args.device, args.fill)
    if args.gpu_busy:
        _keep_busy(args.device)
    engine = create_receiver(args.backend, ModuleTarget(module), device=args.device,
                             rollback=args.rollback)
    server = ReceiverServer(engine, args.bind).start()
    _announce({"address": server.address, "pid": os.getpid()})
    threading.Event().wait()


def vary_seed(seed: int, step: int) -> int:
    """The seed a --vary trainer refills its weights from before update `step` (>= 1)."""
    return 1_000_003 * seed + step


def run_trainer(args: argparse.Namespace) -> None:
    """Send model `args.model` to `args.address` once, or forever with --loop."""
    module = build(args.model, args.seed, args.device, args.fill)
    extra = wire.decode(bytes.fromhex(args.init_hex)) if args.init_hex else {}
    info_cls = get_backend(args.backend).sender_class().init_info_cls
    info = info_cls(**extra)
    client = RPCClient(args.address, timeout_s=info.timeout_s)
    sender = trainer_init(info, client=client, source=ModuleSource(module))
    _announce({"event": "sending", "pid": os.getpid()})
    step = 0
    while True:
        if args.vary and step:
            randomize(module, vary_seed(args.seed, step))  # a training step changed them
        sender.send_weights(weight_version=f"trainer-{step}")
        step += 1
        if not args.loop:
            break
    sender.shutdown()
    _announce({"event": "done", "updates": step})


def main(argv: list[str] | None = None) -> None:
    """Parse the command line and run the chosen role."""
    parser = argparse.ArgumentParser(prog="python -m wtransfer.launch.peer")
    parser.add_argument("role", choices=["receiver", "trainer"])
    parser.add_argument("--backend", default="ipc")
    parser.add_argument("--model", default="mixed")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--fill", choices=["random", "constant"], default="random")
    parser.add_argument("--bind", default="tcp://127.0.0.1:0")
    parser.add_argument("--address", default="")
    parser.add_argument("--init-hex", default="", help="msgpack (hex) of init-info fields")
    parser.add_argument("--loop", action="store_true")
    parser.add_argument("--rollback", action="store_true",
                        help="receiver: restore the old weights when an update fails")
    parser.add_argument("--gpu-busy", action="store_true",
                        help="receiver on CUDA: keep the device's default stream busy, as "
                             "an engine serving requests would (tests of GPU ordering)")
    parser.add_argument("--vary", action="store_true",
                        help="with --loop: refill the weights before every update after the "
                             "first (update k sends build(model, seed) randomized with "
                             "vary_seed(seed, k)), so no two updates carry the same weights")
    args = parser.parse_args(argv)
    _exit_when_parent_goes()
    run_receiver(args) if args.role == "receiver" else run_trainer(args)


if __name__ == "__main__":
    main()
