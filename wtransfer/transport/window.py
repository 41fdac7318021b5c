"""The posting window of the streaming backends (nccl, ucx), one loop per side.

Both sides walk the same bucket plan in the same units (`units`: a packed bucket alone, or a
run of up to `batch` consecutive direct buckets, which a backend may launch as one operation)
and keep up to `max_inflight` units posted ahead, waiting only on the oldest when the window or
a staging slot is needed. A packed bucket needs one of `slots` staging slots until its
operation completed; a direct bucket moves the source tensor's own bytes into the
destination's and needs none. A backend supplies only its primitives: post an operation on
some bytes, wait for one (with its deadline and peer checks).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

import torch

from wtransfer.packing import Bucket

if TYPE_CHECKING:
    from wtransfer.trainer.engine import Share

Op = TypeVar("Op")
"""A backend's handle on one posted operation (a CUDA event, UCX requests, ...)."""


def units(buckets: Sequence[Bucket], batch: int, first: int | None = None
          ) -> list[list[Bucket]]:
    """`buckets` in posting units: each packed bucket alone, runs of up to `batch` consecutive
    direct ones together, the very first unit of at most `first` (the bytes start moving once
    both sides posted it: a small one is ready sooner, the rest is posted while it moves). A
    pure function of the plan, so sender and receivers (which derive the same plan and get
    the same numbers) post the same units: NCCL needs every rank to group its calls alike."""
    out: list[list[Bucket]] = []
    run: list[Bucket] = []
    for bucket in buckets:
        if bucket.direct and batch > 1:
            run.append(bucket)
            if len(run) == (batch if out or first is None else min(batch, first)):
                out.append(run)
                run = []
            continue
        if run:
            out.append(run)
            run = []
        out.append([bucket])
    if run:
        out.append(run)
    return out


def send_windowed(share: Share, slots: int, *, max_inflight: int, batch: int = 1,
                  first: int | None = None,
                  stage: Callable[[Bucket, int], torch.Tensor],
                  post: Callable[[list[Bucket], list[torch.Tensor]], Op],
                  wait: Callable[[Op], None]) -> None:
    """Post every unit of `share` in order. `stage(bucket, slot)` packs a bucket into staging
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

    for unit in units(share.buckets, batch, first):
        direct = unit[0].direct
        while len(inflight) >= max_inflight or not (direct or free):
            retire_oldest()
        if direct:
            slot, data = -1, [packer.direct(bucket) for bucket in unit]
        else:
            slot = free.popleft()
            data = [stage(unit[0], slot)]
        inflight.append((slot, post(unit, data)))
    packer.finish()
    while inflight:
        retire_oldest()


def receive_windowed(buckets: Sequence[Bucket], slots: int, *, max_inflight: int,
                     batch: int = 1, first: int | None = None,
                     destination: Callable[[Bucket], torch.Tensor],
                     staging: Callable[[Bucket, int], torch.Tensor],
                     post: Callable[[list[Bucket], list[torch.Tensor]], Op],
                     wait: Callable[[Op], None],
                     landed: Callable[[Bucket, int, torch.Tensor], None],
                     temporary: Callable[[Bucket], int] | None = None,
                     budget: int = 0) -> None:
    """Receive `buckets` in order, in the sender's units. A direct bucket lands at
    `destination(bucket)` (the parameter itself where the target offers it), a packed one in
    `staging(bucket, slot)`. When the oldest operation completed, `landed(bucket, slot, data)`
    takes each of its buckets' bytes (slot -1 for a direct bucket) and the slot is free again,
    so unpacking overlaps receiving.

    `temporary(bucket)` says how many bytes a direct bucket's destination allocates (0 when it
    lands in the target's own storage); units whose temporaries would take more than `budget`
    bytes in flight wait for earlier ones to land (one unit always goes), so a target that
    offers no storage of its own costs bounded memory, not a model's worth of temporaries."""
    free = deque(range(slots))
    posted: deque[tuple[list[Bucket], int, list[torch.Tensor], Op, int]] = deque()
    upcoming = deque(units(buckets, batch, first))
    held = 0
    head_need: tuple[list[Bucket], int] | None = None
    while upcoming or posted:
        while upcoming and len(posted) < max_inflight:
            unit = upcoming[0]
            need = 0
            if unit[0].direct:
                if temporary is not None:
                    if head_need is None or head_need[0] is not unit:
                        head_need = (unit, sum(temporary(bucket) for bucket in unit))
                    need = head_need[1]
                if posted and held + need > budget:
                    break
                slot, data = -1, [destination(bucket) for bucket in unit]
            elif free:
                slot = free.popleft()
                data = [staging(unit[0], slot)]
            else:
                break
            upcoming.popleft()
            posted.append((unit, slot, data, post(unit, data), need))
            held += need
        unit, slot, data, op, need = posted.popleft()
        wait(op)
        for bucket, landed_bytes in zip(unit, data, strict=True):
            landed(bucket, slot, landed_bytes)
        held -= need
        if slot >= 0:
            free.append(slot)
