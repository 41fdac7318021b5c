"""M->N read in place over CUDA IPC: each worker copies what it keeps straight out of every
trainer rank's own shards; nothing is packed, and an update is one call.

Every rank exports the CUDA storage behind its local shards as a zero-copy sender exports its
tensors (`wtransfer_ipc.zero_copy.ZeroCopyExports`: once, again only when one moves), and the
ranks gather what each exported. The plan is the M->N plan of staged buckets without a bucket
limit (`in_place_planner`): each box of the model comes from one rank holding it (replicas
share the load), whole. The lead's one update call carries every rank's record and pieces
(`IPCUpdateInfo.in_place_ranks`), each piece's offset counted in the rank's local tensor, and
the tensor list, so nothing announces it first (`Outgoing.lead_only`). A
worker opens each rank's storages once, waits on each rank's event after its last write, and
copies the parts of each piece that it keeps (`UpdateSession.load_boxes`: its copies worked
out once and replayed while the records and pieces stay). It answers once its copies ran, so
no rank writes its shards again while they are read. A rank whose shards cannot be shared
(not contiguous, not CUDA) makes every rank send this update through staging, as before.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch

from wtransfer.errors import MetadataError
from wtransfer.packing import TensorMeta
from wtransfer.receiver.boxes import BoxSource
from wtransfer.receiver.session import UpdateSession
from wtransfer.records import Box, TensorLayout
from wtransfer.transport.m2n import Piece, Planner, TransferPlan, pieces_from_wire, runs
from wtransfer_ipc.info import RankInPlace
from wtransfer_ipc.zero_copy import ZeroCopyExports, ZeroCopyImports, shareable

log = logging.getLogger(__name__)

UNBOUNDED = 1 << 62
"""The in-place plan's bucket limit: nothing is staged, so no box is cut."""


def in_place_planner(staged: Planner) -> Planner:
    """The plan of `staged`'s ranks and workers with no bucket limit."""
    return Planner(staged.sources, staged.dests, UNBOUNDED)


def rank_record(exports: ZeroCopyExports, locals_: list[torch.Tensor]) -> dict[str, Any] | None:
    """This rank's zero-copy record of its local shards, or None when one cannot be shared
    (then every rank stages this update: they gather the records either way, so none is
    left waiting in a collective)."""
    if not shareable(t for t in locals_ if t.numel()):
        log.warning("M->N in place: a local shard is not a contiguous CUDA tensor; this update "
                    "goes through staging")
        return None
    try:
        return exports.update(locals_)
    except Exception as exc:  # (the other ranks are about to gather this rank's record)
        log.warning("M->N in place: exporting this rank's shards failed (%s: %s); this update "
                    "goes through staging", type(exc).__name__, exc)
        return None


def offset_in_local(layout: TensorLayout, box: Box) -> int | None:
    """The byte offset of global region `box` in the rank's contiguous local tensor of
    `layout`; None when the region is not one contiguous run of it."""
    found = runs(layout, box)
    return found[0][0] if len(found) == 1 else None


def pieces_by_rank(plan: TransferPlan, sources: Sequence[dict[str, TensorLayout]],
                   metas: Sequence[TensorMeta]) -> list[list[Piece]] | None:
    """Each rank's pieces of `plan`, each offset counted in the rank's local tensor; None
    when a piece is not contiguous there (every rank computes the same answer)."""
    out: list[list[Piece]] = [[] for _ in sources]
    for bucket in plan.buckets:
        for piece in bucket.pieces:
            offset = offset_in_local(sources[bucket.sender][metas[piece.tensor].name],
                                     piece.box)
            if offset is None:
                return None
            out[bucket.sender].append(replace(piece, offset=offset))
    return out


def rank_arrivals(storages: dict[int, torch.Tensor], layout: list[int],
                  pieces: Sequence[Piece], metas: Sequence[TensorMeta]) -> list[BoxSource]:
    """Each of one rank's `pieces` as a box and its bytes, the piece's offset counted in the
    rank's local tensor, which `layout` places in `storages` (uint8, by index)."""
    if len(layout) != 2 * len(metas):
        raise MetadataError(f"a rank's zero_copy layout must hold a storage and an offset for "
                            f"each of the {len(metas)} announced tensors")
    out: list[BoxSource] = []
    for piece in pieces:
        if not 0 <= piece.tensor < len(metas):
            raise MetadataError(f"piece names tensor #{piece.tensor} but only {len(metas)} "
                                "were announced")
        index, start = layout[2 * piece.tensor], layout[2 * piece.tensor + 1]
        data = storages.get(index)
        if data is None:
            raise MetadataError(f"a piece of {metas[piece.tensor].name!r} lies in storage "
                                f"{index}, which its rank does not list")
        begin = start + piece.offset
        if piece.offset < 0 or start < 0 or begin + piece.nbytes > data.numel():
            raise MetadataError(f"a piece of {metas[piece.tensor].name!r} (bytes "
                                f"[{begin}, {begin + piece.nbytes})) does not fit its "
                                f"rank's {data.numel()}-byte storage {index}")
        out.append((piece.tensor, piece.box, data[begin: begin + piece.nbytes]))
    return out


class RanksInPlace:
    """A worker's view of every trainer rank's exported shards (see the module docstring)."""

    def __init__(self) -> None:
        self._ranks: list[ZeroCopyImports] = []
        self._last: tuple[list[Any], list[BoxSource]] | None = None
        """What the last update read (its storages, layouts, pieces and tensor list) and its
        boxes: the same list again while they stay, so the session replays its copies."""

    def load(self, session: UpdateSession, records: Sequence[RankInPlace],
             metas: Sequence[TensorMeta], senders: int, device: torch.device) -> None:
        """Queue the copies of what this worker keeps of every rank's pieces on `device`'s
        current stream (after each rank's event); the caller waits for them."""
        if len(records) != senders:
            raise MetadataError(f"in_place_ranks lists {len(records)} trainer ranks; the "
                                f"transfer has {senders}")
        while len(self._ranks) < senders:
            self._ranks.append(ZeroCopyImports())
        opened = [imports.opened(record.zero_copy, device)
                  for imports, record in zip(self._ranks, records, strict=False)]
        key = [metas, *((storages, record.zero_copy.layout, record.pieces)
                        for (storages, _), record in zip(opened, records, strict=True))]
        if self._last is None or not _same(self._last[0], key):
            arrivals = [box for (storages, layout), record in zip(opened, records, strict=True)
                        for box in rank_arrivals(storages, layout,
                                                 pieces_from_wire(record.pieces), metas)]
            self._last = (key, arrivals)
        session.load_boxes(self._last[1])

    def close(self) -> None:
        """Drop every rank's mappings."""
        for imports in self._ranks:
            imports.close()
        self._ranks = []
        self._last = None


def _same(last: list[Any], key: list[Any]) -> bool:
    """Whether an update reads what the last one read: the same tensor list and storages
    (the very objects) and equal layouts and pieces."""
    return len(last) == len(key) and last[0] is key[0] and all(
        a[0] is b[0] and a[1:] == b[1:] for a, b in zip(last[1:], key[1:], strict=True))
