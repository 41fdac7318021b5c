"""Sender-side pipelining shared by backends: pack bucket k+1 while bucket k is in flight
(`send_pipelined` for backends that make each call themselves, `send_issued` for those whose
calls are pipelined)."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

from wtransfer.packing import Bucket, bucket_checksum

if TYPE_CHECKING:
    from wtransfer.protocol import PendingCall
    from wtransfer.trainer.engine import Share

Transmit = Callable[[Bucket, int, torch.Tensor, "int | None"], None]
"""Moves one bucket to the receivers: ``transmit(bucket, slot, data, checksum)`` where `data` is
the packed bytes (staging slot `slot`) or, for a direct bucket, the source tensor's own bytes
(slot -1). Returns once `data` may be overwritten."""


def send_pipelined(
    share: Share,
    staging: Sequence[torch.Tensor],
    transmit: Transmit,
    *,
    checksum: bool = False,
    before_transmit: Callable[[int], None] | None = None,
) -> None:
    """Pack each bucket of `share` into a free staging slot and hand it to `transmit`.

    `transmit` runs on one background thread, in bucket order, so packing the next bucket
    overlaps moving the previous one; at most `len(staging)` buckets are in flight at once,
    and a slot is reused only after the bucket that used it was confirmed. Direct buckets skip
    staging. `before_transmit(slot)` runs after packing (e.g. to wait for a CUDA stream). The
    first failure cancels what is queued and is re-raised here.
    """
    packer = share.packer
    failed = threading.Event()

    def guarded(bucket: Bucket, slot: int, data: torch.Tensor, digest: int | None) -> None:
        # once one bucket failed, the buckets queued behind it must not each wait out
        # their own deadline: the caller's deadline is one deadline, not one per bucket
        if failed.is_set():
            return
        try:
            transmit(bucket, slot, data, digest)
        except BaseException:
            failed.set()
            raise

    pending: deque[Future[None]] = deque()
    slot_users: dict[int, Future[None]] = {}
    next_slot = 0
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="wtransfer-send")
    try:
        for bucket in share.buckets:
            if len(pending) == len(staging):
                pending.popleft().result()
            if bucket.direct:
                slot, data = -1, packer.direct(bucket)
            else:
                slot, next_slot = next_slot, (next_slot + 1) % len(staging)
                if slot in slot_users:
                    slot_users.pop(slot).result()
                packer.pack(bucket, staging[slot])
                data = staging[slot][: bucket.nbytes]
            if before_transmit is not None:
                before_transmit(slot)
            digest = bucket_checksum(data) if checksum else None
            fut = pool.submit(guarded, bucket, slot, data, digest)
            pending.append(fut)
            if slot >= 0:
                slot_users[slot] = fut
            while pending and pending[0].done():
                pending.popleft().result()
        packer.finish()  # take part in the other senders' gathers while ours are in flight
        while pending:
            pending.popleft().result()
    finally:
        for fut in pending:
            fut.cancel()
        pool.shutdown(wait=True, cancel_futures=True)


Issue = Callable[[Bucket, int, torch.Tensor, "int | None"], "PendingCall"]
"""Issues one bucket's update call without waiting: ``issue(bucket, slot, data, checksum)``
(arguments as for `Transmit`); the call's reply says the receivers are done with `data`."""


def send_issued(
    share: Share,
    staging: Sequence[torch.Tensor],
    issue: Issue,
    *,
    timeout_s: float,
    checksum: bool = False,
    before_issue: Callable[[int], None] | None = None,
    check: Callable[[], None] | None = None,
    before_pack: Callable[[int], None] | None = None,
) -> None:
    """Pack each bucket of `share` into a free staging slot and `issue` its call, without
    waiting for the replies of earlier ones: up to `len(staging)` calls are in flight, and a
    slot is packed again only once the call that used it is answered (within `timeout_s`).
    For backends whose update calls are pipelined (`wtransfer.trainer.calls`): the receivers find the
    next bucket's call waiting when they finish one. `before_pack(slot)` runs before packing
    into a staging slot, `before_issue(slot)` after packing (direct buckets: slot -1);
    `check()` may raise a refusal already answered. The replies of the last calls are left
    for the caller to settle."""
    packer = share.packer
    in_slot: dict[int, PendingCall] = {}
    next_slot = 0
    for bucket in share.buckets:
        if check is not None:
            check()
        if bucket.direct:
            slot, data = -1, packer.direct(bucket)
        else:
            slot, next_slot = next_slot, (next_slot + 1) % len(staging)
            if slot in in_slot:
                in_slot.pop(slot).result(timeout_s)
            if before_pack is not None:
                before_pack(slot)
            packer.pack(bucket, staging[slot])
            data = staging[slot][: bucket.nbytes]
        if before_issue is not None:
            before_issue(slot)
        call = issue(bucket, slot, data, bucket_checksum(data) if checksum else None)
        if slot >= 0:
            in_slot[slot] = call
    packer.finish()  # take part in the other senders' gathers while ours are in flight
