"""M->N over shared staging: each trainer rank stages its own shards, each worker copies
only what it keeps.

Staging every worker of the host can map is a broadcast medium: a byte staged once can be
read by every worker that keeps it. So the plan (`wtransfer.transport.m2n.plan_transfers`)
has one destination that keeps every tensor whole: each box of the model is staged exactly
once, by one of the trainer ranks holding it (ranks holding the same box share the load),
packed straight from that rank's shards into its own staging buffers. Nothing is gathered,
and no rank stages more than `num_buffers x bucket_bytes`. Each bucket's update call lists
its pieces (`IPCUpdateInfo.pieces`), and every worker copies out of it only the parts of each
box that it keeps (`UpdateSession.consume_pieces` with `crop`): the bytes a worker copies
are the bytes it keeps, from every rank's staging at once.

The ranks exchange what they hold at init through the trainer group (with their init
fragments, `wtransfer.transport.m2n.fragment_with_layouts`); the workers' layouts are never
needed on the trainer side.
"""

from __future__ import annotations

from typing import Any

from wtransfer.transport.m2n import PairBucket, pieces_to_wire


def describe(bucket: PairBucket, slot: int, sender: int, checksum: int | None
             ) -> dict[str, Any]:
    """The update info handing over `bucket`, staged in `sender`'s buffer `slot`."""
    return {"buffer": slot, "nbytes": bucket.nbytes, "checksum": checksum,
            "pieces": pieces_to_wire(bucket.pieces), "sender": sender}
