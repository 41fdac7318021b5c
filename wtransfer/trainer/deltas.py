"""The trainer side of delta updates: a last-sent copy to diff against, and each update's
tensor list (see `wtransfer.delta`)."""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from wtransfer.delta.codec import (
    DENSE,
    DeltaEntry,
    encode_sparse,
    index_dtype_for,
    sparse_limit,
)
from wtransfer.delta.compare import LastSent
from wtransfer.delta.estimate import Sample, predicted_moved, sampled
from wtransfer.delta.pieces import WHOLE, EncodedBucket, encode_bucket
from wtransfer.errors import MetadataError
from wtransfer.packing import TensorMeta
from wtransfer.records import DeltaHeader
from wtransfer.trainer.source import WeightSource
from wtransfer.transport.m2n import PairBucket, Piece, TransferPlan

DENSE_FRACTION = 0.5
"""A delta that moved more than this fraction of the model's bytes is a dense one: it saved
little on the wire and paid a comparison and a copy on top."""
DENSE_STREAK = 3
"""After this many dense deltas in a row the sender stops diffing (`FULL_RUN`); the sampled
estimate (`wtransfer.delta.estimate`) usually stops it before the first."""
FULL_RUN = 8
"""Updates then sent in full without comparing (what a sender without deltas pays); all but
the last keep no last-sent copy. The last keeps a sample of what it sent (or, where the
source cannot offer its tensors again, a copy), and the update after it probes: predicted
dense, another run starts, twice as long (up to `FULL_RUN_MOST`); else it goes in full with
a copy, and deltas go on."""
ESTIMATE_FROM = DENSE_FRACTION / 4
"""A delta right after a delta that moved at most this fraction of the model's bytes is not
estimated first (changes rarely turn dense in one step; `DENSE_STREAK` still catches it)."""
FULL_RUN_MOST = 64
"""The longest run of full updates (a run doubles each time the probe after it says dense)."""


class EncodedSource(WeightSource):
    """A delta's tensor list as a source: each changed tensor whole or as its sparse payload,
    already materialized (`held` offers them to backends that read tensors in place)."""

    def __init__(self, items: list[tuple[TensorMeta, torch.Tensor]],
                 device: torch.device | None) -> None:
        self._items = items
        self._device = device

    def metadata(self) -> list[TensorMeta]:
        """The entries as they travel."""
        return [meta for meta, _ in self._items]

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Each entry's tensor (the changed tensor itself, or its payload)."""
        for meta, tensor in self._items:
            yield meta.name, tensor

    def held(self) -> list[torch.Tensor]:
        """Every entry's tensor, in order."""
        return [tensor for _, tensor in self._items]

    @property
    def device(self) -> torch.device | None:
        """Where the trainer's tensors live."""
        return self._device


@dataclass(frozen=True)
class DeltaUpdate:
    """One update of a delta-enabled sender: its header and what to send."""

    header: DeltaHeader
    source: WeightSource
    """The trainer's own source (a full update) or the delta's `EncodedSource`."""
    changed_fraction: float | None
    """A delta's fraction of changed elements; None for a full update."""
    keeps_copy: bool = True
    """Whether the sender takes a last-sent copy of this (full) update once it landed."""
    keeps_sample: bool = False
    """Whether it keeps only a sample of it instead (`wtransfer.delta.estimate.Sample`: the
    last update of a full run, which the next one probes against)."""


class DeltaSender:
    """The last-sent copy of every tensor (on `copy_device`: host memory by default) and the
    token of the update the receivers hold, if any (`base`)."""

    def __init__(self, copy_device: torch.device | str = "cpu") -> None:
        self.copy_device = torch.device(copy_device)
        self.base: str | None = None
        """The token of the last update that landed: the base the next delta applies onto."""
        self.sparse = True
        """Whether the receivers take sparse payloads (False once one refused them: then a
        delta sends each changed tensor whole)."""
        self.disabled: str | None = None
        """Why every update goes full without diffing (the receivers take no deltas)."""
        self._last: LastSent | None = None
        self._metas: list[TensorMeta] = []
        self._pending: str | None = None
        self.dense_streak = 0
        """Dense deltas in a row (see `DENSE_STREAK`)."""
        self.full_left = 0
        """Updates still to send in full without diffing (see `FULL_RUN`)."""
        self.run = FULL_RUN
        """The length of the next run of full updates (see `FULL_RUN`)."""
        self._sample: Sample | None = None
        """What the last update of a run sent, sampled (the next update probes with it)."""
        self._last_moved: float | None = None
        """The fraction of the model's bytes the last delta moved (None: the last update was
        not a delta); a delta is estimated first only after a full update or a delta past
        `ESTIMATE_FROM`."""

    @property
    def copy_bytes(self) -> int:
        """Bytes of the last-sent copy."""
        return self._last.nbytes if self._last is not None else 0

    def prepare(self, source: WeightSource) -> DeltaUpdate:
        """This update: a delta when the receivers hold a base of the same tensor list, else
        a full update (the copy is refreshed once it landed: `landed`)."""
        token = secrets.token_hex(16)
        self._pending = token
        metas = source.metadata()
        last_moved, self._last_moved = self._last_moved, None  # (set again by a delta)
        if self.disabled is not None or not source.delta_ok:
            self._last, self.base = None, None
            return DeltaUpdate(DeltaHeader(token=token), source, None)
        if self.full_left:  # most bytes changed every step lately: send as if without deltas
            self.full_left -= 1
            self._last, self.base = None, None
            last = not self.full_left
            sampling = last and source.held() is not None
            if last and not sampling:  # the probe after this update: one dense delta is enough
                self.dense_streak = DENSE_STREAK - 1
            return DeltaUpdate(DeltaHeader(token=token), source, None,
                               keeps_copy=last and not sampling, keeps_sample=sampling)
        limits = {meta.name: (sparse_limit(meta.numel, index_dtype_for(meta.numel),
                                           meta.itemsize) if self.sparse else 0)
                  for meta in metas}
        held = source.held()
        sample, self._sample = self._sample, None
        if sample is not None and held is not None and sample.metas == metas:
            self._metas = metas  # the probe after a run: dense again, a longer run
            if self._dense(metas, held, sample.of, limits):
                return self._full_run(token, source, min(2 * self.run, FULL_RUN_MOST))
            self.run = FULL_RUN  # else in full with a copy: deltas go on
            return DeltaUpdate(DeltaHeader(token=token), source, None)
        if self.base is None or metas != self._metas or self._last is None:
            self._metas = metas
            return DeltaUpdate(DeltaHeader(token=token), source, None)
        last_sent = self._last
        if held is not None and (last_moved is None or last_moved > ESTIMATE_FROM) \
                and self._dense(metas, held, lambda meta: sampled(last_sent.view(meta.name)),
                                limits):
            return self._full_run(token, source, FULL_RUN)
        items: list[tuple[TensorMeta, torch.Tensor]] = []
        entries: list[DeltaEntry] = []
        total_changed = moved = 0
        by_name = {meta.name: meta for meta in metas}
        found: dict[str, tuple[DeltaEntry, TensorMeta, torch.Tensor]] = {}
        seen: set[str] = set()
        for name, tensor, change in self._last.changes(source.tensors(), limits):
            seen.add(name)
            if change.count == 0:  # (encoded as each group comes: the next one is compared
                continue  # meanwhile on a GPU)
            meta = by_name[name]
            if change.count <= limits[name] and change.index is not None:
                assert change.values is not None
                index_dtype = index_dtype_for(meta.numel)
                payload = (change.payload if change.payload is not None else
                           encode_sparse(change.values, change.index,
                                         index_dtype).to(tensor.device))
                entry = DeltaEntry(meta.name, change.count, index_dtype, meta.dtype)
                found[name] = (entry, entry.wire_meta(meta), payload)
            else:  # (only tensors that go whole are kept)
                found[name] = (DeltaEntry(meta.name, change.count, DENSE, meta.dtype), meta,
                               tensor.detach())
        missing = [meta.name for meta in metas if meta.name not in seen]
        if missing:
            raise MetadataError(f"the source listed {missing[:3]} ({len(missing)} tensors) "
                                f"but did not yield them")
        for meta in metas:
            if meta.name not in found:
                continue
            entry, wire_meta, data = found[meta.name]
            items.append((wire_meta, data))
            moved += (meta.nbytes if entry.index_dtype == DENSE
                      else data.numel() * data.element_size())
            total_changed += entry.count
            entries.append(entry)
        total = sum(m.numel for m in metas)
        fraction = total_changed / total if total else 0.0
        model_bytes = sum(m.nbytes for m in metas)
        self._last_moved = moved / model_bytes if model_bytes else 0.0
        self.dense_streak = (self.dense_streak + 1 if moved > DENSE_FRACTION * model_bytes
                             else 0)
        if self.dense_streak >= DENSE_STREAK:
            self.dense_streak, self.full_left = 0, self.run
        elif not self.dense_streak:
            self.run = FULL_RUN
        header = DeltaHeader(token=token, base=self.base,
                             entries=[e.to_wire() for e in entries])
        return DeltaUpdate(header, EncodedSource(items, source.device), fraction)

    @staticmethod
    def _dense(metas: list[TensorMeta], held: list[torch.Tensor],
               before: Callable[[TensorMeta], torch.Tensor], limits: dict[str, int]) -> bool:
        """Whether a delta of `held` would move more than `DENSE_FRACTION` of the model's
        bytes, by the sample (`wtransfer.delta.estimate`)."""
        model_bytes = sum(meta.nbytes for meta in metas)
        return predicted_moved(metas, held, before, limits) > DENSE_FRACTION * model_bytes

    def _full_run(self, token: str, source: WeightSource, length: int) -> DeltaUpdate:
        """This update in full, the first of a run of `length` (see `FULL_RUN`): no copy."""
        self.run = length
        self.dense_streak, self.full_left = 0, length - 1
        self._last, self.base = None, None
        return DeltaUpdate(DeltaHeader(token=token), source, None, keeps_copy=False)

    def landed(self, update: DeltaUpdate) -> None:
        """`update` landed on every receiver: its token is the base from now on (after a full
        update, the copy is taken of what it sent)."""
        if self.disabled is not None or not update.source.delta_ok:
            return
        if update.keeps_sample:
            source = update.source
            held = source.held()
            self._sample = Sample(source.metadata(), held if held is not None else
                                  [t for _, t in source.tensors()], self.copy_device)
        if not update.keeps_copy:
            self._last = None
            return
        if update.header.base is None:
            self._last = None  # (the old copy goes before the new one is made)
            last = LastSent(update.source.metadata(), self.copy_device)
            last.take(update.source.tensors())
            self._last = last
        self.base = update.header.token

    def forget(self) -> None:
        """An update failed (or was refused): the receivers hold no known base; the next
        update is full."""
        self.base = None


class PairDeltaSender:
    """A trainer rank's side of deltas over an M->N plan: the bytes of each pair bucket it
    last sent (on `copy_device`), for the plan they were sent under, and the token of the
    update the workers hold (`base`). Used by `TrainerTransferEngine` in place of
    `wtransfer.trainer.deltas.DeltaSender` when every rank sends its own shards."""

    def __init__(self, copy_device: torch.device | str = "cpu") -> None:
        self.copy_device = torch.device(copy_device)
        self.base: str | None = None
        self.disabled: str | None = None
        """Why every update goes full (the workers take no deltas)."""
        self.sparse = True
        self._copies: dict[int, torch.Tensor] = {}
        self._plan: str | None = None
        self.changed_fraction: float | None = None
        """The last delta's fraction of changed elements among those this rank sends (None
        for an update of a full run: nothing was compared)."""
        self.wire_bytes = 0
        """Bytes of bucket data the last update moved from this rank."""
        self.dense_streak = 0
        """Dense deltas in a row (see `DENSE_STREAK`)."""
        self.full_left = 0
        """Deltas still to send with every bucket whole, not compared (see `FULL_RUN`)."""
        self.run = FULL_RUN
        """The length of the next run of whole buckets."""

    @property
    def copy_bytes(self) -> int:
        """Bytes of the last-sent copy."""
        return sum(t.numel() for t in self._copies.values())

    def prepare(self, source: WeightSource) -> DeltaUpdate:
        """This update's header: a delta when the workers hold a base this rank has copies
        of, else full."""
        token = secrets.token_hex(16)
        base = self.base if self.disabled is None and self._plan is not None else None
        return DeltaUpdate(DeltaHeader(token=token, base=base, by_piece=True), source, None)

    def encode(self, plan: TransferPlan, mine: Sequence[PairBucket],
               metas: Sequence[TensorMeta], now_of: Callable[[Piece], torch.Tensor]
               ) -> dict[int, EncodedBucket]:
        """A delta: each of this rank's buckets (`now_of(piece)`: a piece's values now), by
        its place in the plan."""
        if not self.holds(plan):
            raise MetadataError("a delta needs the plan of the last full update")
        out: dict[int, EncodedBucket] = {}
        total = changed_elements = 0
        self.wire_bytes = 0
        for bucket in mine:
            position = plan.position(bucket)
            encoded = encode_bucket(bucket, metas, now_of, self._copies[position])
            out[position] = encoded
            elements = sum(p.box.numel for p in bucket.pieces)
            total += elements
            changed_elements += elements if encoded.changed < 0 else encoded.changed
            self.wire_bytes += bucket.nbytes if encoded.size == WHOLE else max(encoded.size, 0)
        self.changed_fraction = changed_elements / total if total else 0.0
        sent = sum(bucket.nbytes for bucket in mine)
        self.dense_streak = self.dense_streak + 1 if self.wire_bytes > DENSE_FRACTION * sent \
            else 0
        if not self.dense_streak:
            self.run = FULL_RUN
        elif self.dense_streak >= DENSE_STREAK:
            self.dense_streak, self.full_left = 0, self.run
        return out

    def whole(self, plan: TransferPlan, mine: Sequence[PairBucket]) -> dict[int, EncodedBucket]:
        """An update of a full run (most bytes changed every step lately): each of this
        rank's buckets goes whole, not compared; the copies are stale until the run's last
        update keeps what it sends (`keep`: its caller asks `full_left == 1` first)."""
        self.full_left -= 1
        if not self.full_left:  # one dense delta after the run starts a longer one
            self.dense_streak = DENSE_STREAK - 1
            self.run = min(2 * self.run, FULL_RUN_MOST)
        self.changed_fraction = None
        self.wire_bytes = sum(bucket.nbytes for bucket in mine)  # (as `encode` counts whole)
        return {plan.position(bucket): EncodedBucket(WHOLE, None, -1) for bucket in mine}

    def kept_in_full(self, plan: TransferPlan) -> None:
        """A full update under `plan` keeps every bucket this rank sends (none, for a rank
        the plan gives no bucket: it still takes part in the next delta's gather); a run of
        whole buckets in progress ends."""
        if plan.digest != self._plan:
            self._copies, self._plan = {}, plan.digest
        self.full_left = 0

    def holds(self, plan: TransferPlan) -> bool:
        """Whether the copies are of `plan`'s buckets (else a delta sends each whole)."""
        return plan.digest == self._plan

    def keep(self, plan: TransferPlan, bucket: PairBucket, data: torch.Tensor) -> None:
        """A full update: `bucket` was packed as `data`; keep its bytes to diff against."""
        if plan.digest != self._plan:
            self._copies, self._plan = {}, plan.digest
        position = plan.position(bucket)
        copy = self._copies.get(position)
        if copy is None or copy.numel() != bucket.nbytes:
            copy = self._copies[position] = torch.empty(bucket.nbytes, dtype=torch.uint8,
                                                        device=self.copy_device)
        copy.copy_(data[: bucket.nbytes])

    def landed(self, update: DeltaUpdate) -> None:
        """`update` landed on every worker: its token is the base from now on."""
        self.base = update.header.token if self.disabled is None else None

    def forget(self) -> None:
        """An update failed or was refused: the next update is full (and copies again)."""
        self.base = None
        self._plan = None
        self.full_left = self.dense_streak = 0
        self.run = FULL_RUN
