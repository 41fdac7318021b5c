"""M->N over shared staging: each trainer rank stages its own shards, each worker copies
only what it keeps.

Staging every worker of the host can map is a broadcast medium: a byte staged once can be
read by every worker that keeps it. So the plan (`wtransfer.transport.mton.plan_transfers`)
has one destination that keeps every tensor whole: each box of the model is staged exactly
once, by one of the trainer ranks holding it (ranks holding the same box share the load),
packed straight from that rank's shards into its own staging buffers. Nothing is gathered,
and no rank stages more than `num_buffers x bucket_bytes`. Each bucket's update call lists
its pieces (`IPCUpdateInfo.pieces`), and every worker copies out of it only the parts of each
box that it keeps (`UpdateSession.consume_pieces` with `crop`): the bytes a worker copies
are the bytes it keeps, from every rank's staging at once.

The ranks exchange what they hold at init through the trainer group (with their init
fragments); the workers' layouts are never needed on the trainer side.
"""

from __future__ import annotations

from typing import Any

from wtransfer.trainer.source import WeightSource
from wtransfer.transport.mton import (
    PairBucket,
    Planner,
    layouts_from_wire,
    layouts_to_wire,
    pieces_to_wire,
)

LAYOUTS = "m2n_layouts"
"""The init fragment field that carries a rank's layouts to the other ranks (never sent to
the workers)."""


def with_layouts(fragment: dict[str, Any], source: WeightSource, sender: int
                 ) -> dict[str, Any]:
    """This rank's init fragment, carrying what it holds of each tensor."""
    return {**fragment, LAYOUTS: layouts_to_wire(source.layouts(sender))}


def planner_of(fragments: list[dict[str, Any]], bucket_bytes: int
               ) -> tuple[Planner, list[dict[str, Any]]]:
    """The plan between the layouts every rank's fragment carries (in sender order), and the
    fragments without them."""
    sources = [layouts_from_wire(f.get(LAYOUTS), f"trainer rank {i}")
               for i, f in enumerate(fragments)]
    stripped = [{k: v for k, v in f.items() if k != LAYOUTS} for f in fragments]
    return Planner(sources, None, bucket_bytes), stripped


def describe(bucket: PairBucket, slot: int, sender: int, checksum: int | None
             ) -> dict[str, Any]:
    """The update info handing over `bucket`, staged in `sender`'s buffer `slot`."""
    return {"buffer": slot, "nbytes": bucket.nbytes, "checksum": checksum,
            "pieces": pieces_to_wire(bucket.pieces), "sender": sender}
