"""M->N over one group: every trainer rank sends each worker the boxes it keeps.

At init every rank of the group (trainer ranks 0..M-1, then the workers) publishes what it
holds in the rendezvous store before it joins the group (`publish_layouts`): a trainer rank
its shards (`wtransfer.trainer.layouts`), a worker what it keeps (`WeightTarget.keeps`, or
every tensor whole). Once the group formed every key is there, so every rank reads them all
(`read_layouts`) and plans the same `wtransfer.transport.mton.TransferPlan` for each tensor
list (`Planner`); the lead's update call carries the plan's digest, and a worker that planned
otherwise refuses the update before any byte moves.

Each pair bucket is one point-to-point message: the sender packs its pieces from its own
shards (`pack`), the worker receives them in its staging and writes each box into place. Both
sides walk their buckets in the plan's round order, so no rank ever waits in a circle.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from wtransfer import wire
from wtransfer.errors import MetadataError, TransferTimeout
from wtransfer.manifest import Manifest
from wtransfer.packing import DTYPES, TensorMeta, frame
from wtransfer.records import TensorLayout
from wtransfer.trainer.layouts import LocalShards
from wtransfer.transport.mton import (
    PairBucket,
    TransferPlan,
    layouts_from_wire,
    layouts_to_wire,
    plan_transfers,
)

_KEY = "m2n/layouts/"


def m2n_store(store: dist.Store) -> dist.Store:
    """The keys of the M->N group in a session's store."""
    return dist.PrefixStore("m2n/group/", store)


def publish_layouts(store: dist.Store, rank: int, layouts: dict[str, TensorLayout]) -> None:
    """Put what rank `rank` holds in the rendezvous (before it joins the group)."""
    store.set(f"{_KEY}{rank}", wire.encode(layouts_to_wire(layouts)))  # type: ignore[arg-type]


def read_layouts(store: dist.Store, ranks: range, timeout_s: float
                 ) -> list[dict[str, TensorLayout]]:
    """What each of `ranks` published, in rank order."""
    keys = [f"{_KEY}{rank}" for rank in ranks]
    try:
        store.wait(keys, timedelta(seconds=timeout_s))
    except RuntimeError as exc:
        raise TransferTimeout(f"M->N: ranks {ranks.start}..{ranks.stop - 1} did not all publish "
                              f"their layouts within {timeout_s:g}s: {exc}") from None
    return [layouts_from_wire(wire.decode(bytes(store.get(key))), f"rank {rank}")
            for rank, key in zip(ranks, keys, strict=True)]


def whole_layouts(metas: list[TensorMeta], replica: int = 0) -> dict[str, TensorLayout]:
    """Every tensor of `metas` held whole."""
    return {m.name: TensorLayout.whole(m.name, m.dtype, m.shape, replica=replica)
            for m in metas}


class Planner:
    """The plan of each tensor list (the last one kept: a trainer sends the same every step)
    between the published layouts."""

    def __init__(self, sources: list[dict[str, TensorLayout]],
                 dests: list[dict[str, TensorLayout]], bucket_bytes: int) -> None:
        self.sources = sources
        self.dests = dests
        self.bucket_bytes = bucket_bytes
        self._last: tuple[Manifest, TransferPlan] | None = None

    def plan(self, manifest: Manifest) -> TransferPlan:
        """The plan moving `manifest`'s tensors."""
        if self._last is None or self._last[0] is not manifest:
            self._last = (manifest, plan_transfers(manifest.metas, self.sources, self.dests,
                                                   self.bucket_bytes))
        return self._last[1]


def check_plan(plan: TransferPlan, digest: str | None) -> None:
    """Refuse an update whose trainer planned otherwise (different layouts or lists)."""
    if digest != plan.digest:
        raise MetadataError(f"M->N plan mismatch: the trainer planned {digest!r}, this worker "
                            f"{plan.digest!r} (the ranks published different layouts); "
                            "initialize the transfer again")


def pack(bucket: PairBucket, metas: list[TensorMeta], shards: LocalShards,
         staging: torch.Tensor, checksum: bool) -> torch.Tensor:
    """Copy `bucket`'s boxes out of this rank's shards into `staging`; the bytes to send."""
    for piece in bucket.pieces:
        meta = metas[piece.tensor]
        out = staging[piece.offset: piece.offset + piece.nbytes].view(
            DTYPES[meta.dtype]).view(piece.box.lengths)
        out.copy_(shards.region(piece.tensor, meta.name, piece.box), non_blocking=True)
    return frame(staging, bucket.nbytes, checksum)


def source_parts(source: Any, metas: list[TensorMeta]) -> list[torch.Tensor]:
    """The tensors of `source` as this rank holds them, in `metas`' order: its shards, its
    own tensors, or (a source that can promise neither) each one it yields."""
    if source.sharded:
        return list(source.parts())
    held = source.held()
    if held is not None:
        return list(held)
    return [tensor for _, tensor in source.tensors()]
