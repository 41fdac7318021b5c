"""Benchmark: the host work of one engine worker applying an M->N update, without the copies.

    python benchmarks/apply_overhead.py --models qwen3-8b --tp 2 --bucket-mb 1024

Everything lives on PyTorch's meta device, where a copy costs nothing, so what is timed is
the bookkeeping a worker does per update on its CPU: checking each piece against the plan,
cropping it to what the worker keeps (`UpdateSession.consume_pieces` with `crop`, as the
ipc M->N receiver calls it for shared staging), and issuing its copies into the worker's
sharded weights (`ShardTarget`). On a GPU that work is what the host adds to the copies, which
run asynchronously. Floor, in the same run: one view of the staging and one `copy_` per piece
into its destination, the least any receiver must issue. Beside it, the same worker taking a
zero-copy update (every tensor whole in the sender's memory; `UpdateSession.load_whole` copies
the parts it keeps), worked out and replayed (`wtransfer.receiver.programs.WholeProgram`).
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from common import median_seconds, print_table, write_json

from wtransfer.inference.config import MODEL_CONFIGS
from wtransfer.inference.model.decoder import load_model, shard_model
from wtransfer.inference.model.parallel import Parallel, layouts
from wtransfer.inference.updates.shard_target import ShardTarget
from wtransfer.manifest import Manifest
from wtransfer.packing import DTYPES, TensorMeta
from wtransfer.receiver.programs import PiecePrograms
from wtransfer.receiver.session import UpdateSession
from wtransfer.transport.m2n import Planner, whole_layouts


def bench(name: str, tp: int, bucket_mb: int, repeats: int) -> dict[str, Any]:
    """Worker 0 of `tp` applying every bucket of one update of model `name`."""
    full = load_model(name, device="meta")
    with torch.device("meta"):
        shard = shard_model(full, Parallel(rank=0, size=tp))
    state = full.state_dict()
    metas = [TensorMeta.of(n, t) for n, t in state.items()]
    kept = layouts(MODEL_CONFIGS[name], Parallel(rank=0, size=tp), state)
    plan = Planner([whole_layouts(metas)], None, bucket_mb << 20).plan(Manifest(metas))
    buckets = plan.of_sender(0)
    staging = torch.empty(bucket_mb << 20, dtype=torch.uint8, device="meta")
    target = ShardTarget(shard, kept)
    live = shard.state_dict()

    def apply(programs: PiecePrograms | None) -> None:
        session = UpdateSession(target, "meta", check_finite=False, programs=programs)
        session.announce(metas)
        session.keep_only(kept)
        for bucket in buckets:
            session.consume_pieces(staging, bucket.nbytes, bucket.pieces, crop=True)
        session.finish()

    kept_programs = PiecePrograms()
    apply(kept_programs)  # the first update works the programs out

    def floor() -> None:
        for bucket in buckets:
            for piece in bucket.pieces:
                meta = metas[piece.tensor]
                src = staging[piece.offset: piece.offset + piece.nbytes].view(DTYPES[meta.dtype])
                live[meta.name].view(-1)[: src.numel() // tp].copy_(src[: src.numel() // tp])

    pieces = sum(len(b.pieces) for b in buckets)
    seconds = median_seconds(lambda: apply(None), repeats)
    replay_s = median_seconds(lambda: apply(kept_programs), repeats)
    floor_s = median_seconds(floor, repeats)
    sources = [torch.empty(m.nbytes, dtype=torch.uint8, device="meta") for m in metas]

    def whole(programs: PiecePrograms | None) -> None:
        """A zero-copy update: every tensor whole in the sender's memory, the worker copies
        its parts (`load_whole`; the update's start has checked the tensor list)."""
        session = UpdateSession(target, "meta", check_finite=False, programs=programs)
        session.precheck(metas)
        session.announce(metas)
        session.load_whole(sources)
        session.finish()

    whole_programs = PiecePrograms()
    whole(whole_programs)
    return {"model": name, "tp": tp, "bucket_mb": bucket_mb, "tensors": len(metas),
            "buckets": len(buckets), "pieces": pieces, "ms": seconds * 1e3,
            "us_piece": seconds / pieces * 1e6, "replay_ms": replay_s * 1e3,
            "floor_ms": floor_s * 1e3, "x_floor": seconds / floor_s,
            "replay_x_floor": replay_s / floor_s,
            "whole_ms": median_seconds(lambda: whole(None), repeats) * 1e3,
            "whole_replay_ms": median_seconds(lambda: whole(whole_programs), repeats) * 1e3}


def main() -> None:
    """Print the table; write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="qwen3-0.6b,qwen3-8b")
    parser.add_argument("--tp", default="2", help="worker counts, comma-separated")
    parser.add_argument("--bucket-mb", default="64,1024", help="MiB, comma-separated")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    rows = [bench(name, int(tp), int(mb), args.repeats) for name in args.models.split(",")
            for tp in args.tp.split(",") for mb in args.bucket_mb.split(",")]
    print("host work of worker 0 applying one M->N update (meta device: no copy costs; "
          "median ms; worked out: every piece checked and placed, as a first update; replayed: "
          "the programs the first update kept; floor: one view and one copy_ per piece; "
          "zero-copy: the whole update read from the sender's tensors, worked out / replayed)")
    print_table(rows, [("model", "model", ""), ("tp", "TP", "d"), ("bucket_mb", "MiB", "d"),
                       ("tensors", "tensors", "d"), ("buckets", "buckets", "d"),
                       ("pieces", "pieces", "d"), ("ms", "ms/update", ".2f"),
                       ("us_piece", "us/piece", ".1f"), ("replay_ms", "replayed ms", ".2f"),
                       ("floor_ms", "floor ms", ".2f"), ("x_floor", "x floor", ".2f"),
                       ("replay_x_floor", "replayed x floor", ".2f"),
                       ("whole_ms", "zero-copy ms", ".2f"),
                       ("whole_replay_ms", "zero-copy replayed ms", ".2f")])
    print(f"wrote {write_json('apply-overhead', rows, vars(args))}")


if __name__ == "__main__":
    main()
