"""Probe (one GPU): what handing staging buckets from one process to another costs, with no
host in the loop, and what per-tensor copies cost against one flat copy.

    python3 benchmarks/handover.py [--model qwen3-8b] [--buckets-mb 16,64,256,1024]

A trainer process packs bucket after bucket of the model's bytes into two staging slots and
an engine process unpacks them; the two are ordered only on the GPU, by
``cuStreamWaitValue32`` / ``cuStreamWriteValue32`` on flags in the shared staging memory
(each slot: a "packed" round the engine waits for, a "read" round the trainer waits for).
The same ring in one process on two streams shows what the second process adds. Then the
engine copies the model's tensors straight out of the trainer's mapped memory: one stream,
large copies alternating over two streams, `torch._foreach_copy_`, a CUDA graph. Every run
is checked bit-exact. Not a wtransfer path: the floor a GPU-ordered packed path could reach.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from common import median_seconds

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from wtransfer.shapes import model_metas

MIB = 1 << 20
Piece = tuple[int, int, int, int]
"""(tensor, offset in it, bytes, offset in the slot)."""


def driver_call(name: str) -> Any:
    lib = ctypes.CDLL("libcuda.so.1")
    fn = getattr(lib, name + "_v2", None) or getattr(lib, name)
    fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


WAIT, WRITE = driver_call("cuStreamWaitValue32"), driver_call("cuStreamWriteValue32")


def wait_value(stream: torch.cuda.Stream, address: int, value: int) -> None:
    """`stream` waits until the int32 at `address` is >= `value`."""
    assert WAIT(ctypes.c_void_p(stream.cuda_stream), address, value, 0) == 0


def write_value(stream: torch.cuda.Stream, address: int, value: int) -> None:
    """`stream` writes `value` to the int32 at `address` once its earlier work ran."""
    assert WRITE(ctypes.c_void_p(stream.cuda_stream), address, value, 0) == 0


def plan(sizes: list[int], bucket: int) -> list[list[Piece]]:
    """The model's bytes cut into buckets of `bucket` bytes."""
    out: list[list[Piece]] = []
    current: list[Piece] = []
    used = 0
    for index, size in enumerate(sizes):
        offset = 0
        while offset < size:
            take = min(size - offset, bucket - used)
            current.append((index, offset, take, used))
            offset += take
            used += take
            if used == bucket:
                out.append(current)
                current, used = [], 0
    if current:
        out.append(current)
    return out


def views(flat: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    out, offset = [], 0
    for size in sizes:
        out.append(flat[offset:offset + size])
        offset += size
    return out


def share(tensor: torch.Tensor) -> list[Any]:
    rec = tensor.untyped_storage()._share_cuda_()
    return [int(rec[0]), rec[1].hex(), int(rec[2]), int(rec[3]), rec[4].hex(), int(rec[5]),
            rec[6].hex() if rec[6] else "", bool(rec[7])]


def open_shared(rec: list[Any]) -> torch.Tensor:
    storage = torch.UntypedStorage._new_shared_cuda(
        rec[0], bytes.fromhex(rec[1]), rec[2], rec[3], bytes.fromhex(rec[4]), rec[5],
        bytes.fromhex(rec[6]) or None, rec[7])
    tensor = torch.empty(0, dtype=torch.uint8, device="cuda:0")
    tensor.set_(storage, 0, (rec[2],), (1,))
    return tensor


def median_ms(fn: Callable[[], Any], repeats: int = 5) -> float:
    return median_seconds(fn, repeats, warmup=0, sync=torch.cuda.synchronize) * 1e3


def pack(stream: torch.cuda.Stream, buckets: list[list[Piece]], slots: list[torch.Tensor],
         srcs: list[torch.Tensor], flags: int, base: int) -> None:
    """Trainer side of one update: slot k % n, round base + k // n + 1 (the updates before
    it ran to the end: the host waits between them)."""
    n = len(slots)
    with torch.cuda.stream(stream):
        for k, bucket in enumerate(buckets):
            slot, rnd = k % n, base + k // n + 1
            if k >= n:
                wait_value(stream, flags + 4 * (n + slot), rnd - 1)
            for index, offset, size, at in bucket:
                slots[slot][at:at + size].copy_(srcs[index][offset:offset + size])
            write_value(stream, flags + 4 * slot, rnd)


def unpack(stream: torch.cuda.Stream, buckets: list[list[Piece]], slots: list[torch.Tensor],
           dsts: list[torch.Tensor], flags: int, base: int) -> None:
    """Engine side of one update."""
    n = len(slots)
    with torch.cuda.stream(stream):
        for k, bucket in enumerate(buckets):
            slot, rnd = k % n, base + k // n + 1
            wait_value(stream, flags + 4 * slot, rnd)
            for index, offset, size, at in bucket:
                dsts[index][offset:offset + size].copy_(slots[slot][at:at + size])
            write_value(stream, flags + 4 * (n + slot), rnd)


def copy_strategies(src: torch.Tensor, dst: torch.Tensor, sizes: list[int]) -> dict[str, Any]:
    srcs, dsts = views(src, sizes), views(dst, sizes)
    side = torch.cuda.Stream()

    def two_streams() -> None:
        current = torch.cuda.current_stream()
        side.wait_stream(current)
        for i, (d, s) in enumerate(zip(dsts, srcs, strict=True)):
            with torch.cuda.stream(side if i % 2 else current):
                d.copy_(s)
        current.wait_stream(side)

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=torch.cuda.Stream()):
        for d, s in zip(dsts, srcs, strict=True):
            d.copy_(s)
    out: dict[str, Any] = {
        "one flat copy": median_ms(lambda: dst.copy_(src)),
        "per tensor, one stream": median_ms(
            lambda: [d.copy_(s) for d, s in zip(dsts, srcs, strict=True)]),
        "per tensor, two streams": median_ms(two_streams),
        "torch._foreach_copy_": median_ms(lambda: torch._foreach_copy_(dsts, srcs)),
        "CUDA graph of the copies": median_ms(graph.replay),
    }
    dst.zero_()
    two_streams()
    torch.cuda.synchronize()
    out["bit-exact"] = bool(torch.equal(dst, src))
    return out


def engine(sizes: list[int]) -> None:
    """The engine process: reads commands on stdin, answers on stdout."""
    torch.cuda.set_device(0)
    cfg = json.loads(sys.stdin.readline())
    src, flags_t = open_shared(cfg["src"]), open_shared(cfg["flags"])
    slots = [open_shared(rec) for rec in cfg["slots"]]
    buckets = plan(sizes, cfg["bucket"])
    dst = torch.empty(sum(sizes), dtype=torch.uint8, device="cuda:0")
    dsts, stream = views(dst, sizes), torch.cuda.Stream()
    print("ready", flush=True)
    for line in sys.stdin:
        command = line.strip()
        if command == "quit":
            return
        if command == "check":
            print(json.dumps(bool(torch.equal(dst, src))), flush=True)
        elif command == "copies":
            print(json.dumps(copy_strategies(src, dst, sizes)), flush=True)
        else:
            start = time.perf_counter()
            unpack(stream, buckets, slots, dsts, flags_t.data_ptr(), int(command))
            stream.synchronize()
            print(json.dumps((time.perf_counter() - start) * 1e3), flush=True)


def one_process(src: torch.Tensor, sizes: list[int], bucket: int, repeats: int
                ) -> tuple[float, bool]:
    """The ring on two streams of this process: median ms, bit-exact."""
    buckets, srcs = plan(sizes, bucket), views(src, sizes)
    slots = [torch.empty(bucket, dtype=torch.uint8, device="cuda:0") for _ in range(2)]
    flags = torch.zeros(4, dtype=torch.int32, device="cuda:0")
    other = torch.empty_like(src)
    dsts, streams, rounds = views(other, sizes), (torch.cuda.Stream(), torch.cuda.Stream()), [0]

    def update() -> None:
        pack(streams[0], buckets, slots, srcs, flags.data_ptr(), rounds[0])
        unpack(streams[1], buckets, slots, dsts, flags.data_ptr(), rounds[0])
        rounds[0] += -(-len(buckets) // 2)

    ms = median_ms(update, repeats)
    return ms, bool(torch.equal(other, src))


def two_processes(src: torch.Tensor, model: str, sizes: list[int], bucket: int, repeats: int,
                  copies: bool) -> dict[str, Any]:
    """The ring between this process and an engine process: median ms, bit-exact, and
    (`copies`) the engine's copy strategies out of this process's memory."""
    buckets, srcs = plan(sizes, bucket), views(src, sizes)
    slots = [torch.empty(bucket, dtype=torch.uint8, device="cuda:0") for _ in range(2)]
    flags = torch.zeros(4, dtype=torch.int32, device="cuda:0")
    torch.cuda.synchronize()
    child = subprocess.Popen([sys.executable, __file__, "--engine", "--model", model],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdin is not None and child.stdout is not None
    ask, answer = child.stdin, child.stdout

    def say(line: str) -> Any:
        ask.write(line + "\n")
        ask.flush()
        return json.loads(answer.readline())

    ask.write(json.dumps({"src": share(src), "flags": share(flags), "bucket": bucket,
                          "slots": [share(s) for s in slots]}) + "\n")
    ask.flush()
    assert answer.readline().strip() == "ready"
    stream, rounds, times = torch.cuda.Stream(), 0, []
    for _ in range(repeats + 1):
        torch.cuda.synchronize()
        start = time.perf_counter()
        ask.write(f"{rounds}\n")
        ask.flush()
        pack(stream, buckets, slots, srcs, flags.data_ptr(), rounds)
        json.loads(answer.readline())
        times.append((time.perf_counter() - start) * 1e3)
        stream.synchronize()
        rounds += -(-len(buckets) // 2)
    out: dict[str, Any] = {"ms": sorted(times[1:])[repeats // 2], "bit-exact": say("check")}
    if copies:
        out["copies"] = say("copies")
    ask.write("quit\n")
    ask.flush()
    child.wait(60)
    return out


def trainer(model: str, buckets_mb: list[int], repeats: int) -> dict[str, Any]:
    torch.cuda.set_device(0)
    sizes = [m.nbytes for m in model_metas(model)]
    src = torch.randint(0, 255, (sum(sizes),), dtype=torch.uint8, device="cuda:0")
    results: dict[str, Any] = {"model": model, "bytes": sum(sizes), "tensors": len(sizes)}
    for mb in buckets_mb:
        alone, exact_alone = one_process(src, sizes, mb * MIB, repeats)
        torch.cuda.empty_cache()
        pair = two_processes(src, model, sizes, mb * MIB, repeats, copies=mb == buckets_mb[0])
        if "copies" in pair:
            results["copies out of the trainer's memory (ms)"] = pair.pop("copies")
        row = {"buckets": len(plan(sizes, mb * MIB)), "two processes ms": pair["ms"],
               "one process ms": alone, "bit-exact": bool(pair["bit-exact"] and exact_alone)}
        results[f"{mb} MiB"] = row
        print(json.dumps({f"{mb} MiB": row}), flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-8b")
    parser.add_argument("--buckets-mb", default="64,1024")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--engine", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.engine:
        engine([m.nbytes for m in model_metas(args.model)])
        return
    out = trainer(args.model, [int(x) for x in args.buckets_mb.split(",")], args.repeats)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
