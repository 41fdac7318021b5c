"""The posting window of the streaming backends (nccl, ucx), one loop per side.

Both sides walk the same bucket plan and keep up to `max_inflight` operations posted ahead,
waiting only on the oldest, when the window or a staging slot is needed. A packed bucket
needs one of `slots` staging slots until its operation completed; a direct bucket moves the
source tensor's own bytes into the destination's and needs none. A backend supplies only its
primitives: post an operation on some bytes, wait for one (with its deadline and peer checks).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

import torch

from wtransfer.packing import Bucket

if TYPE_CHECKING:
    from wtransfer.sender import Share

Op = TypeVar("Op")
"""A backend's handle on one posted operation (a CUDA event, UCX requests, ...)."""


def send_windowed(share: Share, slots: int, *, max_inflight: int,
                  stage: Callable[[Bucket, int], torch.Tensor],
                  post: Callable[[Bucket, torch.Tensor], Op],
                  wait: Callable[[Op], None]) -> None:
    """Post every bucket of `share` in order. `stage(bucket, slot)` packs a bucket into staging
    slot `slot` and returns the bytes to post; a direct bucket posts `share.packer.direct`.
    Packing the next bucket overlaps the operations already posted. Once all are posted the
    packer finishes (its part in other senders' gathers), then every operation is waited on."""
    packer = share.packer
    free = deque(range(slots))
    inflight: deque[tuple[int, Op]] = deque()

    def retire_oldest() -> None:
        slot, op = inflight.popleft()
        wait(op)
        if slot >= 0:
            free.append(slot)

    for bucket in share.buckets:
        while len(inflight) >= max_inflight or not (bucket.direct or free):
            retire_oldest()
        if bucket.direct:
            slot, data = -1, packer.direct(bucket)
        else:
            slot = free.popleft()
            data = stage(bucket, slot)
        inflight.append((slot, post(bucket, data)))
    packer.finish()
    while inflight:
        retire_oldest()


def receive_windowed(buckets: Sequence[Bucket], slots: int, *, max_inflight: int,
                     destination: Callable[[Bucket], torch.Tensor],
                     staging: Callable[[Bucket, int], torch.Tensor],
                     post: Callable[[Bucket, torch.Tensor], Op],
                     wait: Callable[[Op], None],
                     landed: Callable[[Bucket, int, torch.Tensor], None]) -> None:
    """Receive `buckets` in order. A direct bucket lands at `destination(bucket)` (the
    parameter itself where the target offers it), a packed one in `staging(bucket, slot)`.
    When the oldest operation completed, `landed(bucket, slot, data)` takes its bytes (slot -1
    for a direct bucket) and the slot is free again, so unpacking overlaps receiving."""
    free = deque(range(slots))
    posted: deque[tuple[Bucket, int, torch.Tensor, Op]] = deque()
    upcoming = deque(buckets)
    while upcoming or posted:
        while upcoming and len(posted) < max_inflight and (upcoming[0].direct or free):
            bucket = upcoming.popleft()
            if bucket.direct:
                slot, data = -1, destination(bucket)
            else:
                slot = free.popleft()
                data = staging(bucket, slot)
            posted.append((bucket, slot, data, post(bucket, data)))
        bucket, slot, data, op = posted.popleft()
        wait(op)
        landed(bucket, slot, data)
        if slot >= 0:
            free.append(slot)
