"""The receiver side of a delta: `DeltaTarget` takes a delta's tensor list and applies each
entry onto the weights the target holds (see `wtransfer.delta`)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from wtransfer.delta.codec import BITS_VIEW, DeltaEntry, decode_sparse
from wtransfer.errors import DeltaUnsupportedError, MetadataError, SparseDeltaError
from wtransfer.packing import DTYPES, TensorMeta
from wtransfer.receiver.finite import FiniteCheck
from wtransfer.receiver.target import WeightTarget
from wtransfer.records import Box, TensorLayout


class DeltaTarget(WeightTarget):
    """`inner` as a delta's receiver sees it: a dense entry is loaded as any update loads it; a
    sparse entry (a uint8 payload) has its changed elements written into `inner`'s weights in
    place, through its byte view, its regions, or a copy of the tensor loaded back whole."""

    def __init__(self, inner: WeightTarget, entries: Sequence[DeltaEntry], *,
                 finite: FiniteCheck | None = None) -> None:
        if not inner.takes_deltas:
            raise DeltaUnsupportedError(f"this engine's target ({type(inner).__name__}) takes "
                                        "full updates only; the sender sends in full")
        self.inner = inner
        self._finite = finite
        """Where the values of sparse entries are checked (None: not checked)."""
        self._entries = {e.name: e for e in entries}
        self._held: dict[str, TensorMeta] = {}
        self._copies: dict[str, torch.Tensor] = {}
        """Copies of the tensors applied through a copy loaded back whole."""
        kept = inner.keeps()
        self._kept: dict[str, TensorLayout] | None = kept
        problems, unable = [], []
        for entry in entries:
            held = inner.held(entry.name)
            if held is None:
                problems.append(f"unknown tensor {entry.name!r}")
                continue
            self._held[entry.name] = held
            if not entry.dense and (entry.dtype != held.dtype
                                    or not self._writable(entry.name, held)):
                unable.append(entry.name)
        if problems:
            raise MetadataError("delta refused before any weight changed: "
                                + "; ".join(problems[:5]))
        if unable:
            raise SparseDeltaError(f"this engine's target ({type(inner).__name__}) cannot apply "
                                   f"sparse deltas to {unable[:3]} (it offers no view of them, "
                                   "or holds them in another dtype than the sender's); the "
                                   "sender sends changed tensors whole")

    def _boxes(self, name: str) -> tuple[Box, ...] | None:
        """The boxes a sharded worker keeps of `name` when it offers a region of each (None:
        the tensor is applied whole)."""
        layout = self._kept.get(name) if self._kept is not None else None
        if self._kept is None or (layout is not None and layout.is_whole):
            return None
        boxes = layout.boxes if layout is not None else ()  # keeps none of it
        if all(self.inner.region(name, box) is not None for box in boxes):
            return boxes
        return None

    def _writable(self, name: str, held: TensorMeta) -> bool:
        """Whether a sparse entry of `name` can be applied (probing without writing)."""
        layout = self._kept.get(name) if self._kept is not None else None
        if self._boxes(name) is not None:
            return True
        if layout is not None and not layout.is_whole:
            return False  # a shard without regions: nothing to apply it onto
        if (self.inner.direct_bytes(name) is not None
                or self.inner.region(name, Box.whole(held.shape)) is not None):
            return True
        copy = self.inner.snapshot(name)  # kept: `_apply` writes into it, one copy in all
        if copy is not None:
            self._copies[name] = copy
        return copy is not None

    def check(self, metas: Sequence[TensorMeta]) -> None:
        """Dense entries as `inner` checks any tensor it is sent; sparse ones against their
        payload sizes."""
        dense = [m for m in metas if m.name in self._entries and self._entries[m.name].dense]
        named = {m.name for m in metas}
        held = [self.inner.held(c) for m in dense for c in self.inner.companions(m.name)
                if c not in named]  # an unchanged companion: the base's, as held
        self.inner.check(dense + [h for h in held if h is not None])
        rest = [m for m in metas if m not in dense]
        problems = [m.name for m in rest if self.held(m.name) != m]
        if problems:
            raise MetadataError(f"delta refused before any weight changed: {problems[:3]} do "
                                "not match the delta's entries")

    @property
    def stages(self) -> bool:
        """As `inner`."""
        return self.inner.stages

    def metadata(self) -> list[TensorMeta]:
        """Every entry as it travels."""
        return [self._wire(name) for name in self._entries]

    def _wire(self, name: str) -> TensorMeta:
        return self._entries[name].wire_meta(self._held[name])

    def held(self, name: str) -> TensorMeta | None:
        """How entry `name` travels; None for a tensor the delta does not name."""
        return self._wire(name) if name in self._entries else None

    def direct_bytes(self, name: str) -> torch.Tensor | None:
        """A dense entry's storage (as `inner` offers it); None for a sparse one (its payload
        is decoded, not stored)."""
        entry = self._entries.get(name)
        return self.inner.direct_bytes(name) if entry is not None and entry.dense else None

    def snapshot(self, name: str, out: torch.Tensor | None = None) -> torch.Tensor | None:
        """`inner`'s copy of the tensor (a rollback restores it through `inner`)."""
        return self.inner.snapshot(name, out)

    def restore(self, saved: Iterable[tuple[str, torch.Tensor]]) -> None:
        """As `inner` (its snapshots go back to it)."""
        self.inner.restore(saved)

    def companions(self, name: str) -> list[str]:
        """As `inner`."""
        return self.inner.companions(name)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Dense entries load into `inner`; sparse ones are decoded and applied."""
        dense: list[tuple[str, torch.Tensor]] = []
        for name, tensor in weights:
            entry = self._entries[name]
            if entry.dense:
                dense.append((name, tensor))
            else:
                self._apply(entry, tensor)
        if dense:
            self.inner.load_weights(dense)

    def _apply(self, entry: DeltaEntry, payload: torch.Tensor) -> None:
        held = self._held[entry.name]
        index, values = decode_sparse(payload, entry, held)
        if self._finite is not None:
            self._finite.watch(entry.name, values.view(DTYPES[held.dtype]))
        width = BITS_VIEW[DTYPES[held.dtype].itemsize]
        boxes = self._boxes(entry.name)
        if boxes is not None:
            for box in boxes:
                region = self.inner.region(entry.name, box)
                assert region is not None  # checked at construction
                _write_in_box(region.view(width), box, held.shape, index, values)
            return
        flat = self.inner.direct_bytes(entry.name)
        if flat is not None:
            flat.view(width).index_copy_(0, index.to(flat.device), values.to(flat.device))
            return
        region = self.inner.region(entry.name, Box.whole(held.shape))
        if region is not None:
            _write_in_box(region.view(width), Box.whole(held.shape), held.shape, index, values)
            return
        copy = self._copies.pop(entry.name)  # taken at construction (`_writable`)
        copy.reshape(-1).view(width).index_copy_(0, index, values.to(copy.device))
        self.inner.load_weights([(entry.name, copy)])

    def fingerprint(self) -> dict[str, str]:
        """As `inner`."""
        return self.inner.fingerprint()


def _write_in_box(region: torch.Tensor, box: Box, shape: Sequence[int], index: torch.Tensor,
                  values: torch.Tensor) -> None:
    """Write the elements at global flat `index` that lie in `box` into `region` (the box's
    view, in the elements' integer dtype)."""
    coords, rest = [], index
    for dim in reversed(shape):
        coords.append(rest % dim)
        rest = rest // dim
    coords.reverse()
    inside = torch.ones_like(index, dtype=torch.bool)
    for coord, start, length in zip(coords, box.offsets, box.lengths, strict=True):
        inside &= (coord >= start) & (coord < start + length)
    local = tuple((coord[inside] - start).to(region.device)
                  for coord, start in zip(coords, box.offsets, strict=True))
    if local and local[0].numel():
        region[local] = values[inside].to(region.device)


def piece_delta_refusal(target: WeightTarget, metas: Sequence[TensorMeta]) -> str | None:
    """Why `target` cannot apply a delta of an M->N transfer of `metas` in place (None: it
    can): it takes no deltas, holds one of them in another dtype or shape than it is sent in
    (an FP8 engine fed the checkpoint's dtype), or offers no writable region of something it
    keeps of one (`wtransfer.delta.pieces`)."""
    name = type(target).__name__
    if not target.takes_deltas:
        return f"this engine's target ({name}) takes full updates only"
    kept = target.keeps()
    for meta in metas:
        held = target.held(meta.name)
        if held is None or (held.dtype, held.shape) != (meta.dtype, meta.shape):
            return (f"this engine's target ({name}) holds {meta.name!r} otherwise than it is "
                    "sent, so a delta of it has no base to apply onto")
        layout = kept.get(meta.name) if kept is not None else TensorLayout.whole(
            meta.name, meta.dtype, meta.shape)
        for box in layout.boxes if layout is not None else ():
            if box.numel and target.region(meta.name, box) is None:
                return (f"this engine's target ({name}) offers no region of {meta.name!r} to "
                        "apply a delta to in place")
    return None
