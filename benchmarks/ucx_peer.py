"""Peer for the raw-UCX floor of benchmarks/transfer.py: connects to the benchmark, receives
`repeats + 1` single buffers of `nbytes` (tags 0..), acknowledging each with 8 bytes."""

from __future__ import annotations

import argparse

import torch
from wtransfer_ucx.transport import UCXWorker, tag

ACK = 1 << 40


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--nbytes", type=int, required=True)
    parser.add_argument("--repeats", type=int, required=True)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    ucx = UCXWorker()
    ep = ucx.connect("127.0.0.1", args.port)
    buffer = torch.empty(args.nbytes, dtype=torch.uint8, device=args.device)
    ack = torch.zeros(8, dtype=torch.uint8)
    for i in range(args.repeats + 1):
        ucx.wait([ucx.recv(buffer, tag(0, 0, i))], 600)
        ucx.wait([ucx.send(ep, ack, ACK + i)], 600)
    ucx.close()


if __name__ == "__main__":
    main()
