"""How a sender stages and lays out an update: its staging sizes resolved against a backend's
defaults (`sized`), where staging lives (`staging_device`), and each tensor list as this
sender sends it (`SenderPlans`: the manifest, the bucket plan, which sender owns each bucket,
this sender's buckets; kept while the list stays, a trainer sends the same list every step).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TypeVar

import torch

from wtransfer.manifest import Manifest, PlanParams
from wtransfer.packing import Bucket, BucketPlan, TensorMeta
from wtransfer.records import TrainerInitInfo
from wtransfer.trainer.source import WeightSource

InfoT = TypeVar("InfoT", bound=TrainerInitInfo)


def sized(info: InfoT, bucket_bytes: int | None, num_buffers: int | None,
          default: Callable[[int | None], tuple[int, int]]) -> InfoT:
    """`info` with the staging size asked (`bucket_bytes`, `num_buffers`), each left None
    taking the backend's default (`default(bucket_bytes)`: its bucket capacity and number of
    buffers, `TrainerTransferEngine._default_staging`)."""
    if bucket_bytes is not None and num_buffers is not None:
        return replace(info, bucket_bytes=bucket_bytes, num_buffers=num_buffers)
    bucket, buffers = default(bucket_bytes)
    return replace(info, bucket_bytes=bucket if bucket_bytes is None else bucket_bytes,
                   num_buffers=buffers if num_buffers is None else num_buffers)


def staging_device(override: str | None, source: WeightSource) -> torch.device:
    """Where a sender's staging lives: the init info's `device` when given, else the
    source's."""
    if override:
        return torch.device(override)
    return source.device or torch.device("cpu")


@dataclass(frozen=True)
class SenderPlan:
    """A tensor list as one sender sends it."""

    manifest: Manifest
    plan: BucketPlan
    owners: list[int]
    """The sender index of each bucket of `plan`."""
    mine: tuple[Bucket, ...]
    """This sender's buckets (none for a rank that does not send)."""


class SenderPlans:
    """The last `SenderPlan`, given again while the list, the plan parameters and the
    senders stay."""

    def __init__(self) -> None:
        self._last: tuple[PlanParams, int, int | None, SenderPlan] | None = None

    def of(self, metas: list[TensorMeta], params: PlanParams, senders: int,
           index: int | None) -> SenderPlan:
        """`metas` laid out by `params` over `senders` senders, this one being sender `index`
        (None: a rank that does not send)."""
        last = self._last
        if last is not None and last[:3] == (params, senders, index) \
                and last[3].manifest.metas == metas:
            return last[3]
        manifest = Manifest(metas)
        mine = manifest.shares(params, senders)[index] if index is not None else ()
        plan = SenderPlan(manifest, manifest.plan(params), manifest.owners(params, senders),
                          mine)
        self._last = (params, senders, index, plan)
        return plan
