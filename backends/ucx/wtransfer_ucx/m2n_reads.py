"""M->N by one-sided reads: each worker pulls its pair buckets out of every trainer rank's own
shards (`UCXTrainerInitInfo.rma` with `m2n`).

Every rank registers its local shards once (again only when one moves or changes size,
`wtransfer_ucx.remote_reads.ExportedTensors`), and the ranks gather what each registered; the
lead's update call carries every rank's table (`UCXUpdateInfo.rma_ranks`). A worker plans the
same `TransferPlan` as with tagged messages, and for each of its pair buckets reads every
piece out of the rank that sends it into a staging slot, packed as that rank would have
packed it, then writes the pieces into place (`UpdateSession.consume_pieces`): the bytes it
reads are the bytes it keeps. A piece that is contiguous in the rank's shard (rows of a
tensor sharded by rows, whole experts) is one read; one that is not (a rank's rows of the
columns a worker keeps) is one read per contiguous run, found from the rank's layout. The
ranks pack nothing and post nothing: the lead's update call is answered once every worker's
reads completed, and no rank returns from `send_weights` before that (the ranks' verdict), so
none writes its shards while they are read.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from wtransfer.errors import MetadataError
from wtransfer.packing import TensorMeta
from wtransfer.receiver.session import UpdateSession
from wtransfer.records import TensorLayout
from wtransfer.transport.m2n import PairBucket, runs
from wtransfer_ucx.info import ReadsUpdate
from wtransfer_ucx.remote_reads import ImportedKeys
from wtransfer_ucx.rma import Reads, RemoteKey

log = logging.getLogger(__name__)


class RankReads:
    """A worker's reads out of every trainer rank: the keys each rank sent, unpacked for the
    endpoint to that rank (see the module docstring)."""

    def __init__(self) -> None:
        self._ranks: list[ImportedKeys] = []

    def read_buckets(self, session: UpdateSession, buckets: Sequence[PairBucket],
                     metas: Sequence[TensorMeta], sources: Sequence[dict[str, TensorLayout]],
                     tables: Sequence[ReadsUpdate], endpoints: Sequence[Any],
                     staging: Sequence[torch.Tensor], *, timeout_s: float,
                     check: Callable[[], None] | None = None) -> None:
        """Check every rank's table against what it holds (`sources`), then read `buckets`
        (this worker's, in round order) a staging slot each, `len(staging)` at a time, and
        write each into place."""
        if len(tables) != len(sources) or len(endpoints) != len(sources):
            raise MetadataError(f"rma_ranks lists {len(tables)} trainer ranks; the transfer "
                                f"has {len(sources)}")
        while len(self._ranks) < len(sources):
            self._ranks.append(ImportedKeys())
        names = [m.name for m in metas]
        where = [self._ranks[r].sources(
            names, [held[m.name].nbytes if m.name in held else 0 for m in metas],
            tables[r], endpoints[r], timeout_s) for r, held in enumerate(sources)]
        device = staging[0].device
        if device.type == "cuda":  # the engine's own work on its weights ends first
            torch.cuda.current_stream(device).synchronize()
        for first in range(0, len(buckets), len(staging)):
            batch = buckets[first: first + len(staging)]
            reads = {r: Reads(endpoints[r]) for r in {b.sender for b in batch}}
            try:
                for bucket, slot in zip(batch, staging, strict=False):
                    self._post(bucket, slot, metas, sources[bucket.sender],
                               where[bucket.sender], reads[bucket.sender])
                for pending in reads.values():
                    pending.finish(timeout_s, check)
            finally:  # (a failure part-way: every rank's requests are still freed)
                for pending in reads.values():
                    pending.release()
            for bucket, slot in zip(batch, staging, strict=False):
                session.consume_pieces(slot, bucket.nbytes, bucket.pieces)
            if device.type == "cuda":  # written into place before the slots are read again
                torch.cuda.current_stream(device).synchronize()

    @staticmethod
    def _post(bucket: PairBucket, slot: torch.Tensor, metas: Sequence[TensorMeta],
              held: dict[str, TensorLayout], where: dict[int, tuple[int, RemoteKey]],
              reads: Reads) -> None:
        """Start the reads of `bucket`'s pieces into `slot`, each at its offset."""
        if bucket.nbytes > slot.numel():
            raise MetadataError(f"a pair bucket of {bucket.nbytes} bytes does not fit this "
                                f"worker's {slot.numel()}-byte staging")
        base = slot.data_ptr()
        for piece in bucket.pieces:
            meta = metas[piece.tensor] if 0 <= piece.tensor < len(metas) else None
            if meta is None or meta.name not in held or piece.tensor not in where:
                raise MetadataError(f"a piece of tensor #{piece.tensor} names trainer rank "
                                    f"{bucket.sender}, which holds none of it")
            if piece.offset + piece.nbytes > bucket.nbytes:
                raise MetadataError(f"a piece of {meta.name!r} ends past its bucket")
            address, key = where[piece.tensor]
            at = base + piece.offset
            for offset, length in runs(held[meta.name], piece.box):
                reads.get(at, length, address + offset, key, into_cuda=slot.is_cuda)
                at += length

    def close(self) -> None:
        """Release every rank's keys (before the endpoints close)."""
        for keys in self._ranks:
            keys.close()
        self._ranks = []


def rank_table(exports: Any, locals_: list[torch.Tensor], metas: Sequence[TensorMeta]
               ) -> dict[str, Any] | None:
    """This rank's ``rma`` table (its local shards, registered), or None when one is not
    contiguous or registering failed (then every rank sends tagged pair buckets this update:
    the ranks gather the tables either way, so none is left waiting in a collective)."""
    if not all(t.is_contiguous() for t in locals_):
        log.warning("M->N reads: a local shard is not contiguous; this update goes as tagged "
                    "pair buckets")
        return None
    try:
        return exports.update(locals_, metas)
    except Exception as exc:  # (the other ranks are about to gather this rank's table)
        log.warning("M->N reads: registering this rank's shards failed (%s: %s); this update "
                    "goes as tagged pair buckets", type(exc).__name__, exc)
        return None
