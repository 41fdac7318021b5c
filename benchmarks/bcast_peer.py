"""Peer (rank 1) for the raw-broadcast floor and per-tensor baseline of benchmarks/transfer.py.

Receives, `repeats + 1` times each: one broadcast of a flat buffer holding every byte of the
model, then one broadcast per tensor; a one-element all-reduce after each round is the barrier.
"""

from __future__ import annotations

import argparse
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from wtransfer.packing import byte_view
from wtransfer.shapes import build


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--repeats", type=int, required=True)
    args = parser.parse_args()
    model = build(args.model, seed=2, device="cpu", fill="constant")
    tensors = [byte_view(t) for t in model.state_dict().values()]
    store = dist.TCPStore("127.0.0.1", args.port, None, False, timedelta(seconds=120))
    pg: Any = dist.ProcessGroupGloo(store, 1, 2, timedelta(seconds=600))
    flat = torch.empty(sum(t.numel() for t in tensors), dtype=torch.uint8)
    one = torch.zeros(1)
    for group in ([flat], tensors):
        for _ in range(args.repeats + 1):
            for t in group:
                pg.broadcast(t, 0).wait()
            pg.allreduce([one]).wait()


if __name__ == "__main__":
    main()
