"""Sender-side pipelining shared by backends: pack bucket k+1 while bucket k is in flight."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from wtransfer.packing import Bucket, BucketPacker, BucketPlan, bucket_checksum
from wtransfer.source import WeightSource

Transmit = Callable[[Bucket, int, "int | None"], None]
"""Moves bucket (packed in staging slot `slot`, with optional checksum) to the receivers and
returns once the slot may be overwritten."""


def send_pipelined(
    plan: BucketPlan,
    source: WeightSource,
    staging: Sequence[torch.Tensor],
    transmit: Transmit,
    *,
    checksum: bool = False,
    before_transmit: Callable[[int], None] | None = None,
) -> None:
    """Pack each bucket of `plan` into a free staging slot and hand it to `transmit`.

    `transmit` runs on one background thread, in bucket order, so packing the next bucket
    overlaps moving the previous one; with `len(staging)` slots at most that many buckets are
    packed-but-unconfirmed at once. `before_transmit(slot)` runs after packing (e.g. to wait
    for a CUDA stream). The first failure cancels what is queued and is re-raised here.
    """
    packer = BucketPacker(plan, source.tensors())
    pending: deque[Future[None]] = deque()
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="wtransfer-send")
    try:
        for bucket in plan.buckets:
            slot = bucket.index % len(staging)
            if len(pending) == len(staging):
                pending.popleft().result()
            packer.pack(bucket, staging[slot])
            if before_transmit is not None:
                before_transmit(slot)
            digest = bucket_checksum(staging[slot][: bucket.nbytes]) if checksum else None
            pending.append(pool.submit(transmit, bucket, slot, digest))
            if pending[0].done():
                pending.popleft().result()
        packer.finish()
        while pending:
            pending.popleft().result()
    finally:
        for fut in pending:
            fut.cancel()
        pool.shutdown(wait=True, cancel_futures=True)
