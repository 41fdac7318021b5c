"""`Manifest`: one tensor list and what both sides derive from it, each worked out once.

A trainer sends the same tensor list every step. The list's metas, its wire form, its digest
and its bucket plans belong together: a sender builds one `Manifest` per list it sends, a
receiver keeps the last one it got (`Manifests`) so that an update may name it by digest, and
whatever is derived from the list (plans, a target's check, zero-copy and read exports) keys
on the manifest object itself instead of on copies of its parts.

`PlanParams` are the inputs of a plan besides the list (bucket size, alignment, the size from
which a tensor moves on its own): the sender chooses them and they travel as one record in
the receivers' init info, so both sides build the same plan.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, cast

from wtransfer.errors import ConfigError, MetadataError
from wtransfer.packing import (
    DEFAULT_ALIGN,
    Bucket,
    BucketPlan,
    TensorMeta,
    metas_from_wire,
    metas_to_wire,
)
from wtransfer.wire import digest


@dataclass(frozen=True, kw_only=True)
class PlanParams:
    """How a tensor list is laid out in buckets (`BucketPlan.build`'s inputs besides it)."""

    bucket_bytes: int
    """Capacity of one bucket."""
    align: int = DEFAULT_ALIGN
    """Byte alignment of every tensor inside a bucket."""
    direct_threshold: int = 0
    """Tensors of at least this many bytes are buckets of their own (`direct`); 0: never."""

    def __post_init__(self) -> None:
        if self.align < 1 or self.align & (self.align - 1):
            raise ConfigError(f"plan align must be a positive power of two, got {self.align}")
        if self.bucket_bytes < self.align:
            raise ConfigError(f"plan bucket_bytes must be >= align ({self.align}), "
                              f"got {self.bucket_bytes}")
        if self.direct_threshold < 0:
            raise ConfigError(f"plan direct_threshold must be >= 0, "
                              f"got {self.direct_threshold}")

    def with_direct(self, threshold: int) -> PlanParams:
        """The same parameters with another direct threshold."""
        return replace(self, direct_threshold=threshold)


class Manifest:
    """One tensor list: its `metas`, its `wire` form, its `digest`, and its plans (built once
    per `PlanParams`)."""

    __slots__ = ("_owners", "_plans", "digest", "metas", "wire")

    def __init__(self, metas: Sequence[TensorMeta], wire: list[Any] | None = None) -> None:
        self.metas: list[TensorMeta] = list(metas)
        self.wire: list[Any] = metas_to_wire(self.metas) if wire is None else wire
        """The list as it travels: ``[[name, dtype, shape], ...]``."""
        self.digest: str = digest(self.wire)
        """`wtransfer.wire.digest` of `wire`: what an update names the list by once the
        receivers hold it."""
        self._plans: dict[PlanParams, BucketPlan] = {}
        self._owners: dict[tuple[PlanParams, int], tuple[list[int], list[tuple[Bucket, ...]]]] = {}

    @classmethod
    def from_wire(cls, wire: object) -> Manifest:
        """Parse a list that came off the wire (`MetadataError` when malformed)."""
        metas = metas_from_wire(wire)
        return cls(metas, list(cast("Sequence[Any]", wire)))

    def plan(self, params: PlanParams) -> BucketPlan:
        """The bucket plan of this list under `params` (built on first use)."""
        plan = self._plans.get(params)
        if plan is None:
            plan = self._plans[params] = BucketPlan.build(
                self.metas, params.bucket_bytes, params.align,
                direct_threshold=params.direct_threshold)
        return plan

    def owners(self, params: PlanParams, senders: int) -> list[int]:
        """Which of `senders` trainer ranks sends each bucket of the plan (`BucketPlan.owners`)."""
        return self._split(params, senders)[0]

    def shares(self, params: PlanParams, senders: int) -> list[tuple[Bucket, ...]]:
        """Each sender's buckets of the plan, in order (sender i's at index i)."""
        return self._split(params, senders)[1]

    def _split(self, params: PlanParams, senders: int
               ) -> tuple[list[int], list[tuple[Bucket, ...]]]:
        split = self._owners.get((params, senders))
        if split is None:
            plan = self.plan(params)
            owners = plan.owners(senders)
            split = self._owners[(params, senders)] = (owners, [
                tuple(b for b, o in zip(plan.buckets, owners, strict=True) if o == sender)
                for sender in range(senders)])
        return split

    @property
    def total_bytes(self) -> int:
        """Bytes of every tensor's contents."""
        return sum(m.nbytes for m in self.metas)

    def __len__(self) -> int:
        return len(self.metas)


class Manifests:
    """The last tensor list a receiver got, so the next update may name it by digest: an update
    carries the list (`tensors`, parsed again only when it differs) or `tensors_digest` of the last
    one; anything else is refused before any weight changes."""

    def __init__(self) -> None:
        self.last: Manifest | None = None
        """The last list (what the next update will most likely name)."""

    def resolve(self, tensors: object, tensors_digest: str | None) -> Manifest | None:
        """The manifest the update carries or names (the same object while unchanged); None
        when it does neither."""
        if tensors is not None and tensors_digest is not None:
            raise MetadataError("an update carries 'tensors' or 'tensors_digest', not both")
        if tensors is not None:
            if self.last is None or self.last.wire != tensors:
                self.last = Manifest.from_wire(tensors)
            return self.last
        if tensors_digest is None:
            return None
        if self.last is None or self.last.digest != tensors_digest:
            raise MetadataError(f"tensors_digest {tensors_digest!r} does not name the tensor "
                                "list this receiver got last; the sender must send 'tensors'")
        return self.last
