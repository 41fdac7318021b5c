"""Which way of moving a model's tensors over NCCL can reach the wire? (two GPUs)

Raw NCCL through wtransfer's ctypes binding, with no wtransfer send path, control plane or
Python bookkeeping: rank 0 on cuda:0 sends, rank 1 on cuda:1 receives, both in child processes
of this one. Each strategy moves every byte of a Qwen3-shaped tensor list; its time runs from
a barrier to a 1-byte broadcast rank 1 makes after all its own work (so the receiver's unpacking
counts). Median of `--repeats` after one warm-up, against one broadcast of a flat buffer
holding every byte (the floor), measured in the same run.

    python3 benchmarks/nccl_strategies.py --model qwen3-8b

Strategies: one broadcast per tensor; the same in NCCL group calls of G tensors (one launch per
group); packed buckets (copies into staging overlapped with the broadcasts on a second stream,
ordered by CUDA events only, no host waits), optionally with tensors of at least D MiB
broadcast on their own.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
from wtransfer_nccl.libnccl import load_nccl

from wtransfer.launch.models import build
from wtransfer.packing import Bucket, BucketPlan, TensorMeta, byte_view

PACKED = [(1024, 2, None), (1024, 4, None), (256, 4, None), (64, 8, None), (256, 4, 64),
          (256, 4, 16), (64, 4, 4)]
"""(bucket MiB, staging buffers, direct from MiB) of the packed strategies."""


class Rank:
    """One side: its communicator, streams and the model's tensors as bytes."""

    def __init__(self, rank: int, port: int, model: str) -> None:
        self.rank = rank
        self.device = torch.device(f"cuda:{rank}")
        torch.cuda.set_device(self.device)
        store = dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=60))
        self.lib = load_nccl()
        if rank == 0:
            store.set("uid", self.lib.unique_id().hex())
        store.wait(["uid"])
        self.comm = self.lib.init_rank(2, bytes.fromhex(store.get("uid").decode()), rank)
        state = build(model, seed=1 + rank, device=str(self.device), fill="constant").state_dict()
        self.tensors = [byte_view(t) for t in state.values()]
        self.metas = [TensorMeta.of(n, t) for n, t in state.items()]
        self.total = sum(t.numel() for t in self.tensors)
        self.flat = torch.empty(self.total, dtype=torch.uint8, device=self.device)
        self.wire = torch.cuda.Stream(self.device)
        self.copies = torch.cuda.Stream(self.device)
        self.one = torch.zeros(1, dtype=torch.uint8, device=self.device)

    def broadcast(self, tensor: torch.Tensor, root: int = 0) -> None:
        """Enqueue an in-place broadcast on the wire stream."""
        self.lib.broadcast(self.comm, tensor.data_ptr(), tensor.numel(), root,
                           self.wire.cuda_stream)

    def barrier(self) -> None:
        """Rank 1's 1-byte broadcast after all its work; the host waits for it."""
        self.wire.wait_stream(self.copies)
        self.broadcast(self.one, root=1)
        self.wire.synchronize()

    def per_tensor(self) -> None:
        """One broadcast per tensor."""
        for tensor in self.tensors:
            self.broadcast(tensor)

    def grouped(self, size: int) -> Callable[[], None]:
        """Broadcasts per tensor, `size` per NCCL group call."""
        def run() -> None:
            for start in range(0, len(self.tensors), size):
                self.lib.group_start()
                for tensor in self.tensors[start : start + size]:
                    self.broadcast(tensor)
                self.lib.group_end()
        return run

    def packed(self, bucket_mb: int, slots: int, direct_mb: int | None) -> Callable[[], None]:
        """Buckets packed into `slots` staging buffers (copies on their own stream)."""
        plan = BucketPlan.build(self.metas, bucket_mb << 20, 256,
                                direct_threshold=(direct_mb << 20) if direct_mb else 0)
        buffers = [torch.empty(bucket_mb << 20, dtype=torch.uint8, device=self.device)
                   for _ in range(slots)]

        def pieces(bucket: Bucket, staging: torch.Tensor) -> list[tuple[torch.Tensor,
                                                                        torch.Tensor]]:
            return [(staging[s.offset : s.offset + s.nbytes],
                     self.tensors[s.tensor][s.tensor_offset : s.tensor_offset + s.nbytes])
                    for s in bucket.slices]

        def run() -> None:
            free: list[torch.cuda.Event | None] = [None] * slots
            used = 0
            for bucket in plan.buckets:
                if bucket.direct:
                    self.broadcast(self.tensors[bucket.slices[0].tensor])
                    continue
                slot, used = used % slots, used + 1
                staging, ready = buffers[slot], free[slot]
                if self.rank == 0:
                    if ready is not None:
                        self.copies.wait_event(ready)
                    with torch.cuda.stream(self.copies):
                        for dst, src in pieces(bucket, staging):
                            dst.copy_(src, non_blocking=True)
                    self.wire.wait_stream(self.copies)
                    self.broadcast(staging[: bucket.nbytes])
                    free[slot] = self.wire.record_event()
                else:
                    if ready is not None:
                        self.wire.wait_event(ready)
                    self.broadcast(staging[: bucket.nbytes])
                    self.copies.wait_stream(self.wire)
                    with torch.cuda.stream(self.copies):
                        for dst, src in pieces(bucket, staging):
                            src.copy_(dst, non_blocking=True)
                    free[slot] = self.copies.record_event()
        return run

    def measure(self, label: str, run: Callable[[], None], repeats: int,
                floor: float | None) -> float:
        """Median seconds of `run` between barriers; rank 0 prints a line."""
        times = []
        for i in range(repeats + 1):
            self.barrier()
            start = time.perf_counter()
            run()
            self.barrier()
            if i:
                times.append(time.perf_counter() - start)
        median = statistics.median(times)
        if self.rank == 0:
            ratio = (floor or median) / median
            print(f"{label:48s} {median * 1e3:8.2f} ms {self.total / median / 1e9:7.1f} GB/s "
                  f"vs floor {ratio:5.2f}", flush=True)
        return median


def run_rank(rank: int, port: int, model: str, repeats: int) -> None:
    """Every strategy, in the same order on both ranks."""
    side = Rank(rank, port, model)
    if rank == 0:
        print(f"{model}: {len(side.tensors)} tensors, {side.total / 1e9:.2f} GB, "
              f"NCCL {side.lib.version()}", flush=True)
    floor = side.measure("floor: one broadcast of every byte", lambda: side.broadcast(side.flat),
                         repeats, None)
    side.measure("one broadcast per tensor", side.per_tensor, repeats, floor)
    for size in (8, 32, 1024):
        side.measure(f"per tensor, {size} per group call", side.grouped(size), repeats, floor)
    for bucket_mb, slots, direct_mb in PACKED:
        label = f"packed {bucket_mb} MiB x{slots}" + (f", direct >= {direct_mb} MiB"
                                                      if direct_mb else "")
        side.measure(label, side.packed(bucket_mb, slots, direct_mb), repeats, floor)
    side.measure("floor again", lambda: side.broadcast(side.flat), repeats, floor)
    side.lib.abort(side.comm)


def main() -> None:
    """Start both ranks as child processes (or, with --rank, be one)."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-8b")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank is not None:
        run_rank(args.rank, args.port, args.model, args.repeats)
        return
    if torch.cuda.device_count() < 2:
        sys.exit("needs two CUDA devices")
    store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=60),
                          wait_for_workers=False)
    children = [subprocess.Popen([sys.executable, __file__, "--model", args.model,
                                  "--repeats", str(args.repeats), "--rank", str(rank),
                                  "--port", str(store.port)], env=dict(os.environ))
                for rank in (0, 1)]
    sys.exit(max(child.wait() for child in children))


if __name__ == "__main__":
    main()
