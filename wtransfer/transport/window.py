"""The one send loop and the one receive loop every backend's buckets go through.

Both sides walk the same bucket plan in the same units (`units`: a packed bucket alone, or a
run of up to `batch` consecutive direct buckets, which a backend may launch as one operation)
and keep up to `max_inflight` units posted ahead, waiting only on the oldest when the window or
a staging slot is needed. A packed bucket needs one of `slots` staging slots until its
operation completed; a direct bucket moves the source tensor's own bytes into the
destination's and needs none.

A backend supplies only its primitives, as a channel: `SendChannel` for a data plane of its
own (stage a bucket into a slot, post an operation on some bytes, wait for one with its
deadline and peer checks: nccl, ucx), or `CallChannel` where each bucket's update call hands
it over (stage, and describe the call: ipc, the inline example). The sender base turns a
`CallChannel` into posts of update calls and runs `send_buckets`; receivers of streaming
backends run `receive_buckets`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar, cast

import torch

from wtransfer.packing import Bucket


class SendUnit(Protocol):
    """What the loops need of a bucket: `Bucket`, or an M->N `PairBucket` (never direct)."""

    @property
    def direct(self) -> bool:
        """Whether it moves a source tensor's own bytes (no staging slot)."""


B = TypeVar("B", bound=SendUnit)

Op = TypeVar("Op")
"""A backend's handle on one posted operation (a CUDA event, UCX requests, a pending call)."""

Check = Callable[[], None]
"""Raises a failure the receivers already reported (a refused update call); never blocks."""


class Packer(Protocol):
    """What the send loop needs of a bucket packer (`BucketPacker`, `GatheringPacker`)."""

    def direct(self, bucket: Bucket) -> torch.Tensor:
        """The source bytes of a direct bucket."""

    def finish(self) -> None:
        """Every own bucket is posted: take part in the other senders' gathers, check the
        source yielded everything."""


@dataclass(frozen=True)
class SendChannel(Generic[Op]):
    """A backend's own data plane for one sender's buckets (nccl broadcasts, ucx messages)."""

    slots: int
    """Staging slots; a packed bucket holds one until its operation completed."""
    stage: Callable[[Any, int], torch.Tensor]
    """Pack a bucket (a `Bucket`, or what the backend's units are) into a slot; returns the
    bytes to post."""
    post: Callable[[list[Any], int, list[torch.Tensor]], Op]
    """Start moving one unit's bytes (a packed bucket in staging slot `slot`, or a run of
    direct ones, slot -1): ``post(unit, slot, data)``."""
    wait: Callable[[Op, Check], None]
    """Wait for a posted operation, with the transfer's deadline, raising what `check` (the
    receivers' answers) or the peers report meanwhile."""
    max_inflight: int = 0
    """Units posted ahead (0: `slots`)."""
    batch: int = 1
    """Consecutive direct buckets one post may carry."""
    first: int | None = None
    """At most this many in the first unit (None: `batch`)."""


@dataclass(frozen=True)
class CallChannel:
    """Buckets handed over by their own update calls (ipc, the inline example): a slot is
    packed again only once the call that carried it was answered."""

    slots: int
    stage: Callable[[Any, int], torch.Tensor]
    """Pack a bucket (a `Bucket`, or an M->N `PairBucket`) into a slot; returns the packed
    bytes."""
    describe: Callable[[Any, int, torch.Tensor, int | None], dict[str, Any]]
    """The update info that hands over bucket `bucket` packed in slot `slot` (its bytes and,
    with checksums on, their checksum): ``describe(bucket, slot, data, checksum)``."""


def units(buckets: Sequence[B], batch: int, first: int | None = None) -> list[list[B]]:
    """`buckets` in posting units: each packed bucket alone, runs of up to `batch` direct ones
    together, the first unit of at most `first`. A pure function of the plan, so the sender and
    every receiver post the same units (NCCL needs every rank to group its calls alike)."""
    out: list[list[B]] = []
    run: list[B] = []
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


def send_buckets(buckets: Sequence[SendUnit], packer: Packer, channel: SendChannel[Op], *,
                 check: Check, all_posted: Callable[[], None] | None = None) -> None:
    """Post every unit of `buckets` in order through `channel`: a packed one into a free staging
    slot, a direct one from the source's own bytes. `check()` runs before each unit; once all are
    posted, `all_posted()` runs, the packer finishes, then every operation is waited on."""
    free = deque(range(channel.slots))
    inflight: deque[tuple[int, Op]] = deque()
    window = channel.max_inflight or channel.slots

    def retire_oldest() -> None:
        slot, op = inflight.popleft()
        channel.wait(op, check)
        if slot >= 0:
            free.append(slot)

    for unit in units(buckets, channel.batch, channel.first):
        check()
        direct = unit[0].direct
        while len(inflight) >= window or not (direct or free):
            retire_oldest()
        if direct:
            slot, data = -1, [packer.direct(cast(Bucket, bucket)) for bucket in unit]
        else:
            slot = free.popleft()
            data = [channel.stage(unit[0], slot)]
        inflight.append((slot, channel.post(unit, slot, data)))
    if all_posted is not None:
        all_posted()
    packer.finish()
    while inflight:
        retire_oldest()


def receive_buckets(buckets: Sequence[B], slots: int, *, max_inflight: int,
                     batch: int = 1, first: int | None = None,
                     destination: Callable[[B], torch.Tensor],
                     staging: Callable[[B, int], torch.Tensor],
                     post: Callable[[list[B], list[torch.Tensor]], Op],
                     wait: Callable[[Op], None],
                     landed: Callable[[B, int, torch.Tensor], None],
                     temporary: Callable[[B], int] | None = None,
                     budget: int = 0) -> None:
    """Receive `buckets` in the sender's units: a direct one at `destination(bucket)`, a packed one
    in `staging(bucket, slot)`; `landed(bucket, slot, data)` takes each as its operation completes
    (slot -1: direct), freeing the slot. `temporary(bucket)`: bytes a direct destination allocates;
    units wait while more than `budget` such bytes are in flight (one always goes)."""
    free = deque(range(slots))
    posted: deque[tuple[list[B], int, list[torch.Tensor], Op, int]] = deque()
    upcoming = deque(units(buckets, batch, first))
    held = 0
    head_need: tuple[list[B], int] | None = None
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
