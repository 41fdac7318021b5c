"""Which way to find a group's changed words on the GPU: today's word compare, `nonzero` and
gather (`wtransfer.delta.compare_kernels`) against a candidate that counts changed words per
block beside the mask and compacts each block's changed words with a one-dimensional scan (no
`nonzero`, no `searchsorted`). Same group, same changes, outputs checked equal, median of
`--repeats`, against one copy of the group (docs/deltas.md says why this is the next try).

    python3 benchmarks/delta_compaction.py --group-mb 512 --fractions 0.0003,0.01
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import triton
import triton.language as tl
from gpu_paths import d2d_floor, timed

from wtransfer.delta import compare_kernels as current
from wtransfer.delta.compare_kernels import block_words


@triton.jit
def _mark_kernel(ptrs, words, word0, block_tensor, block_start,  # type: ignore[no-untyped-def]
                 copy, mask, block_counts, BLOCK: tl.constexpr):
    program = tl.program_id(0)
    _, _, at, inside, now, was = block_words(ptrs, words, word0, block_tensor, block_start,
                                             copy, program, BLOCK)
    changed = (now != was).to(tl.int8)
    tl.store(mask + at, changed, mask=inside)
    tl.store(block_counts + program, tl.sum(changed.to(tl.int32), axis=0))


@triton.jit
def _compact_kernel(ptrs, words, word0, block_tensor, block_start,  # type: ignore[no-untyped-def]
                    copy, mask, block_counts, block_ends, word_out, owner_out, now_out,
                    was_out, BLOCK: tl.constexpr):
    program = tl.program_id(0)
    count = tl.load(block_counts + program)
    if count > 0:
        tensor = tl.load(block_tensor + program)
        offsets = tl.load(block_start + program) + tl.arange(0, BLOCK)
        inside = offsets < tl.load(words + tensor)
        at = tl.load(word0 + tensor) + offsets
        changed = tl.load(mask + at, mask=inside, other=0).to(tl.int32)
        hit = changed != 0
        source = tl.load(ptrs + tensor).to(tl.pointer_type(tl.int64))
        now = tl.load(source + offsets, mask=hit, other=0)
        was = tl.load(copy + at, mask=hit, other=0)
        out = (tl.load(block_ends + program) - count
               + (tl.cumsum(changed, axis=0) - changed).to(tl.int64))
        tl.store(word_out + out, at, mask=hit)
        tl.store(owner_out + out, tensor.to(tl.int64), mask=hit)
        tl.store(now_out + out, now, mask=hit)
        tl.store(was_out + out, was, mask=hit)
        tl.store(copy + at, now, mask=hit)


def today(table: current.GroupTable, copy: torch.Tensor
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Word compare, `nonzero`, gather: (run word, tensor, now, was) per changed word."""
    mask = torch.empty(copy.numel(), dtype=torch.bool, device=copy.device)
    current.compare(table, copy, mask)
    word = torch.nonzero(mask).squeeze(1)
    owner, now, was = current.gather(table, word, copy)
    return word, owner, now, was


def candidate(table: current.GroupTable, copy: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mark and count per block, a running total, compact per block: the same outputs."""
    blocks = table.block_tensor.numel()
    mask = torch.empty(copy.numel(), dtype=torch.int8, device=copy.device)
    counts = torch.empty(blocks, dtype=torch.int32, device=copy.device)
    columns = (table.ptrs, table.words, table.starts, table.block_tensor, table.block_start,
               copy, mask, counts)
    _mark_kernel[(blocks,)](*columns, BLOCK=current.BLOCK, num_warps=8)
    ends = torch.cumsum(counts, 0, dtype=torch.int64)
    total = int(ends[-1])  # (the group's one sync)
    outs = [torch.empty(total, dtype=torch.int64, device=copy.device) for _ in range(4)]
    _compact_kernel[(blocks,)](*columns, ends, *outs, BLOCK=current.BLOCK, num_warps=8)
    return outs[0], outs[1], outs[2], outs[3]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--group-mb", type=int, default=512)
    parser.add_argument("--tensors", type=int, default=16)
    parser.add_argument("--fractions", default="0.0003,0.01")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    device = torch.device("cuda", 0)
    per = (args.group_mb << 20) // 8 // args.tensors
    gen = torch.Generator(device=device).manual_seed(1)
    tensors = [torch.randint(-1 << 62, 1 << 62, (per,), device=device, generator=gen)
               for _ in range(args.tensors)]
    starts = [i * per for i in range(args.tensors)]
    table = current.GroupTable.build(tensors, starts, per * args.tensors)
    flat = torch.cat(tensors)
    copy_ms = d2d_floor(flat.numel() * 8, args.repeats) * 1e3
    print(f"group {args.group_mb} MiB in {args.tensors} tensors; one copy {copy_ms:.3f} ms")
    for fraction in (float(f) for f in args.fractions.split(",")):
        last = flat.clone()
        elements = last.view(torch.int16)
        hit = torch.rand(elements.shape, device=device, generator=gen) < fraction
        elements[hit] ^= 1
        results = {}
        for name, way in (("today", today), ("candidate", candidate)):
            results[name] = way(table, last.clone())
            runs = iter([last.clone() for _ in range(args.repeats + 1)])  # (each run's own)

            def once(way: Callable[..., object] = way, runs: object = runs) -> object:
                return way(table, next(runs))  # type: ignore[call-overload]

            ms = timed(once, args.repeats) * 1e3
            print(f"{fraction:.2%} changed: {name} {ms:.3f} ms ({ms / copy_ms:.2f}x the copy)",
                  flush=True)
        same = all(torch.equal(a, b) for a, b in zip(results["today"], results["candidate"],
                                                      strict=True))
        print(f"   outputs equal: {same} ({results['today'][0].numel()} changed words)")


if __name__ == "__main__":
    main()
