"""One trainer rank's part of an M->N update, for backends that move each pair bucket as a
message of its own (nccl, ucx): which buckets it sends, how each is staged, and what the
lead's update call adds (the plan's digest; for a delta, what every bucket of the plan is).

Without deltas each bucket is packed from the rank's own shards. A delta-enabled sender
(`wtransfer.trainer.deltas.PairDeltaSender`) keeps what each bucket was in a full update; in a
delta it encodes every bucket before any moves (`wtransfer.delta.pieces`), the ranks gather
what each bucket is, and only changed buckets travel, each whole or as its encoding. After
a few dense deltas a rank sends a run of deltas with every bucket whole, not compared; the
last of the run keeps what it sent (`PairDeltaSender.whole`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from wtransfer.delta.pieces import UNCHANGED, WHOLE, gathered_sizes
from wtransfer.packing import frame
from wtransfer.trainer.deltas import PairDeltaSender
from wtransfer.trainer.engine import Share
from wtransfer.trainer.layouts import LocalShards, held_parts
from wtransfer.trainer.source import WeightSource
from wtransfer.transport.m2n import PairBucket, TransferPlan


@dataclass(frozen=True)
class PairSend:
    """What one rank sends of an M->N update (see the module docstring)."""

    units: tuple[PairBucket, ...]
    """Its buckets that travel, in round order."""
    stage: Callable[[PairBucket, torch.Tensor], torch.Tensor]
    """Stage a bucket into a staging slot (uint8, room for a checksum trailer); the bytes to
    send."""
    opening: dict[str, Any]
    """What the lead's update call carries besides the tensor list."""
    moved: dict[str, Any]
    """This rank's `TransferStats` fields."""


def pair_send(share: Share, plan: TransferPlan, source: WeightSource, *, checksum: bool,
              gather: Callable[[Any], list[Any]], delta: PairDeltaSender | None) -> PairSend:
    """This rank's part of `plan` (`gather`: every trainer rank's record, a collective)."""
    metas = share.manifest.metas
    me = share.index
    shards = LocalShards(metas, share.parts if share.parts is not None
                         else held_parts(source, metas), me)
    mine = tuple(plan.of_sender(me))
    moved = plan.moved(me)
    opening: dict[str, Any] = {"plan_digest": plan.digest}
    header = share.header
    if delta is None or header is None:
        return PairSend(mine, lambda bucket, staging: shards.pack_framed(
            bucket, metas, staging, checksum), opening, moved)

    def keep(bucket: PairBucket, staging: torch.Tensor) -> torch.Tensor:
        """Pack the bucket whole and keep what it is, to diff the next delta against."""
        delta.keep(plan, bucket, shards.pack(bucket, metas, staging))
        return frame(staging, bucket.nbytes, checksum)

    if header.base is None or not delta.holds(plan):
        delta.kept_in_full(plan)
        if header.base is not None:  # a delta over a new plan (the tensor list changed):
            opening["delta_buckets"] = [WHOLE] * len(plan.buckets)  # every bucket whole
        return PairSend(mine, keep, opening, {**moved, "wire_bytes": moved["sent_bytes"]})
    keeps = delta.full_left == 1  # (the last update of a full run keeps what it sends)
    encoded = (delta.whole(plan, mine) if delta.full_left else
               delta.encode(plan, mine, metas, lambda piece: shards.region(
                   piece.tensor, metas[piece.tensor].name, piece.box)))
    sizes = gathered_sizes(plan, gather([[p, e.size] for p, e in encoded.items()]))

    def stage(bucket: PairBucket, staging: torch.Tensor) -> torch.Tensor:
        change = encoded[plan.position(bucket)]
        if keeps:
            return keep(bucket, staging)
        if change.size == WHOLE or change.data is None:
            return shards.pack_framed(bucket, metas, staging, checksum)
        staging[:change.size].copy_(change.data)
        return frame(staging, change.size, checksum)

    units = tuple(b for b in mine if encoded[plan.position(b)].size != UNCHANGED)
    return PairSend(units, stage, {**opening, "delta_buckets": sizes},
                    {**moved, "wire_bytes": delta.wire_bytes,
                     "changed_fraction": delta.changed_fraction})
