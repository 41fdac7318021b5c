"""A worker's pair buckets of one M->N update (for backends that move each pair bucket as a
message of its own: nccl, ucx): which of them travel, how long each is, and how each lands.

In a full update every bucket travels whole. In a delta (`wtransfer.delta.pieces`) the update
call says what each bucket of the plan is (`delta_buckets`): unchanged ones do not travel
(their pieces are counted as they are), the others travel whole or as their encoding.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from wtransfer.delta.pieces import UNCHANGED, WHOLE
from wtransfer.errors import MetadataError
from wtransfer.packing import read_checksum_trailer
from wtransfer.receiver.session import UpdateSession
from wtransfer.transport.m2n import PairBucket, TransferPlan


class PairReceipt:
    """What worker `worker` receives of `plan` in one update, and how it lands in `session`
    (`sizes`: the update's `delta_buckets`, None for a full update)."""

    def __init__(self, plan: TransferPlan, worker: int, sizes: Sequence[int] | None,
                 session: UpdateSession) -> None:
        self._session = session
        self._plan = plan
        self._encoded: dict[int, int] = {}
        """The encoded length of each bucket that travels as a delta, by its place in the
        plan (as the trainer side keys them)."""
        mine = plan.of_worker(worker)
        if sizes is None:
            if session.piece_delta:
                raise MetadataError("a delta of an M->N transfer must say what each bucket is "
                                    "(delta_buckets)")
            self.moving = mine
            return
        if not session.piece_delta:
            raise MetadataError("delta_buckets came in an update that is not a delta")
        if len(sizes) != len(plan.buckets):
            raise MetadataError(f"delta_buckets lists {len(sizes)} buckets, the plan has "
                                f"{len(plan.buckets)}")
        self.moving = []
        for bucket in mine:
            size = sizes[plan.position(bucket)]
            if size == UNCHANGED:
                session.skip_pieces(bucket.pieces)
                continue
            if size != WHOLE:
                if not 0 < size <= bucket.nbytes:
                    raise MetadataError(f"a delta bucket of {size} bytes, where the whole "
                                        f"bucket takes {bucket.nbytes}")
                self._encoded[plan.position(bucket)] = size
            self.moving.append(bucket)

    def nbytes(self, bucket: PairBucket) -> int:
        """How many bytes `bucket` travels as (its checksum trailer excluded)."""
        return self._encoded.get(self._plan.position(bucket), bucket.nbytes)

    def land(self, bucket: PairBucket, staging: torch.Tensor, checksum: bool) -> None:
        """`bucket` arrived in `staging` (with its checksum trailer when `checksum`): write it
        into place."""
        nbytes = self.nbytes(bucket)
        expected = read_checksum_trailer(staging, nbytes) if checksum else None
        if self._plan.position(bucket) in self._encoded:
            self._session.consume_piece_delta(staging, nbytes, bucket.pieces, expected)
        else:
            self._session.consume_pieces(staging, nbytes, bucket.pieces, expected)
