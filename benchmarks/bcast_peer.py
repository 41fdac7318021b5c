"""A peer (rank R of W) for the raw-broadcast floor and per-tensor baseline of
benchmarks/transfer.py (NCCL when --device is a CUDA device, gloo on CPU).

Receives, `repeats + 1` times each: one broadcast of a flat buffer holding every byte of the
model, then one broadcast per tensor; a one-element all-reduce after each round is the barrier.
"""

from __future__ import annotations

import argparse
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from wtransfer.launch.models import build
from wtransfer.packing import byte_view


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--repeats", type=int, required=True)
    parser.add_argument("--rank", type=int, default=1)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    nccl = args.device.startswith("cuda")
    if nccl:
        torch.cuda.set_device(args.device)
    model = build(args.model, seed=2, device=args.device, fill="constant")
    tensors = [byte_view(t) for t in model.state_dict().values()]
    store = dist.TCPStore("127.0.0.1", args.port, None, False, timedelta(seconds=120))
    pg: Any = (dist.ProcessGroupNCCL(store, args.rank, args.world,
                                     dist.ProcessGroupNCCL.Options()) if nccl else
               dist.ProcessGroupGloo(store, args.rank, args.world, timedelta(seconds=600)))
    flat = torch.empty(sum(t.numel() for t in tensors), dtype=torch.uint8, device=args.device)
    one = torch.zeros(1, device=args.device)
    for group in ([flat], tensors):
        for _ in range(args.repeats + 1):
            for t in group:
                pg.broadcast([t], dist.BroadcastOptions()).wait()
            pg.allreduce([one]).wait()
        if nccl:
            torch.cuda.synchronize()


if __name__ == "__main__":
    main()
