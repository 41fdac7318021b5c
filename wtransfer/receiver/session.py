"""Receive-side bookkeeping shared by every backend: validate, place, assemble, verify.

A backend only has to deliver bucket bytes; `UpdateSession` does the rest for one
start -> finish update:

    announce(metas)   every tensor checked against the target before any byte is written
    consume(...)      one bucket: checksum, bounds of every slice, then load into the target
    finish()          every announced tensor arrived whole, else `IntegrityError`

Tensors split across buckets go straight into the target's storage when it offers a byte view
(`WeightTarget.direct_bytes`); otherwise they are assembled in one temporary buffer each.

An M->N transfer (`wtransfer.transport.m2n`) sends each worker only what it keeps, as boxes
of the global tensors from several trainer ranks: `keep_only(layouts)` says what that is, and
`consume_pieces` writes each box into the target's own region of the tensor
(`WeightTarget.region`), or into a whole-tensor buffer loaded once complete for a target
that offers none. A tensor is complete once every element it keeps arrived, exactly once.

With a `rollback` store the session copies each tensor's old value to host memory just before
the first byte of it is written (into the store's buffers, reused across updates, so the cost
is one copy, not an allocation); `rollback()` puts every such value back, so a failed update
leaves the target exactly as it was (and `touched` becomes False again).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from wtransfer.copies import WHOLE_UPDATE_STREAMS, CopyQueue, copy_bytes
from wtransfer.delta.codec import BITS_VIEW, DeltaEntry
from wtransfer.delta.pieces import decode_bucket
from wtransfer.errors import IntegrityError, MetadataError, NonFiniteError
from wtransfer.manifest import Manifest, Manifests
from wtransfer.packing import (
    DTYPES,
    Bucket,
    Slice,
    TensorMeta,
    bucket_checksum,
    tensor_from_bytes,
)
from wtransfer.receiver.boxes import BoxSource, add_copy, plan_boxes
from wtransfer.receiver.copy_graph import replay_copies
from wtransfer.receiver.deltas import DeltaTarget
from wtransfer.receiver.finite import FiniteCheck
from wtransfer.receiver.programs import (
    PieceProgram,
    PiecePrograms,
    ProgramContext,
    WholeProgram,
)
from wtransfer.receiver.target import WeightTarget
from wtransfer.records import Box, TensorLayout
from wtransfer.transport.m2n import Piece


class _Partial:
    """A tensor whose bytes arrive over several buckets, in any order (several senders may
    each send some of them)."""

    __slots__ = ("buffer", "direct", "received", "spans")

    def __init__(self, buffer: torch.Tensor, direct: bool) -> None:
        self.buffer = buffer
        self.direct = direct
        self.received = 0
        self.spans: list[tuple[int, int]] = []


class _Regions:
    """The boxes of one tensor an M->N update delivered so far."""

    __slots__ = ("boxes", "expected", "full", "received")

    def __init__(self, expected: int) -> None:
        self.expected = expected
        self.received = 0
        self.boxes: list[Box] = []
        self.full: torch.Tensor | None = None
        """The whole tensor being assembled, for a target that offers no regions."""


class _Batch:
    """One bucket's work: byte copies issued together, then whole-tensor loads."""

    __slots__ = ("arrived", "assembled", "completed", "direct", "dsts", "loads", "srcs")

    def __init__(self) -> None:
        self.direct: list[tuple[TensorMeta, torch.Tensor, torch.Tensor]] = []
        """Whole tensors copied straight into the target: (meta, destination, source)."""
        self.dsts: list[torch.Tensor] = []
        self.srcs: list[torch.Tensor] = []
        self.loads: list[tuple[str, torch.Tensor]] = []
        self.assembled: list[tuple[str, torch.Tensor]] = []
        self.completed: list[tuple[TensorMeta, torch.Tensor]] = []
        """Tensors split across buckets that this bucket completed, and their bytes."""
        self.arrived: list[tuple[str, torch.Tensor]] = []
        """Whole tensors of this bucket, for the finite check (one call per bucket)."""


class UpdateSession:
    """The state of one update on the receiving side (see the module docstring)."""

    def __init__(self, target: WeightTarget, device: torch.device | str, *,
                 rollback: dict[str, torch.Tensor] | None = None,
                 check_finite: bool = True, programs: PiecePrograms | None = None) -> None:
        self._target: WeightTarget = target
        self._origin = target
        """The engine's target (a delta's `_target` wraps it; rollback restores into it)."""
        self._device = torch.device(device)
        if self._device.type == "cuda" and self._device.index is None:  # ("cuda" != "cuda:0")
            self._device = torch.device("cuda", torch.cuda.current_device())
        self._store = rollback
        """Host buffers by tensor name, owned by the receiver (None: no rollback)."""
        self._saved: set[str] = set()
        self._metas: list[TensorMeta] = []
        self._pending: dict[str, TensorMeta] = {}
        self._announced: dict[str, TensorMeta] = {}
        self._partials: dict[str, _Partial] = {}
        self._kept: dict[str, TensorLayout] | None = None
        """What an M->N update delivers of each tensor (`keep_only`); None: whole tensors."""
        self._regions: dict[str, _Regions] = {}
        self._prechecked: Sequence[TensorMeta] | None = None
        """A list the target passed while the update was opening (`precheck`)."""
        self.touched = False
        """True once any byte of the target changed: a failure after this leaves weights torn."""
        self.bytes_received = 0
        self.piece_delta = False
        """A delta of an M->N transfer (`apply_piece_delta`)."""
        self.finite = FiniteCheck() if check_finite else None
        """Watches every value that arrives; `finish` refuses the update if one was NaN or
        infinite (None: the sender allowed non-finite values)."""
        self._landed: list[tuple[TensorMeta, torch.Tensor]] = []
        """Tensors a backend writes straight into the target (`complete_direct`), checked at
        `finish`, once every write has landed."""
        self._programs = programs
        """M->N buckets' copies kept across updates (`wtransfer.receiver.programs`)."""
        if programs is not None:
            programs.update_started()
        self._listed: Sequence[TensorMeta] | None = None
        """The list `announce` was given (the same object while the sender's list stays)."""
        self._context: ProgramContext | None = None
        self._replayed: set[tuple[int, tuple[Piece, ...], bool]] = set()
        self._unprogrammed = False
        """Whether a bucket of this update was consumed without a program (then none is
        replayed after it)."""

    def apply_delta(self, entries: Sequence[DeltaEntry]) -> None:
        """This update is a delta (`wtransfer.delta`): its tensor list is `entries` as they
        travel, applied onto the weights the target holds (the caller said so first:
        `WeightTarget.patching`); rollback copies stay the target's."""
        if self._announced:
            raise MetadataError("a delta header must come before the update's tensors")
        self._target = DeltaTarget(self._origin, entries, finite=self.finite)

    def apply_piece_delta(self) -> None:
        """This update is a delta of an M->N transfer (`wtransfer.delta.pieces`): its pair
        buckets carry their pieces' changes, applied in place onto the base the target holds
        (the caller told the target, `WeightTarget.patching`, and checked it can:
        `wtransfer.receiver.deltas.piece_delta_refusal`)."""
        if self._announced:
            raise MetadataError("a delta header must come before the update's tensors")
        self.piece_delta = True

    def consume_piece_delta(self, staging: torch.Tensor, nbytes: int, pieces: Sequence[Piece],
                            checksum: int | None = None) -> None:
        """Apply one delta bucket of `nbytes` (its encoding, `wtransfer.delta.pieces`): each
        piece whole, its changed elements, or nothing, into the target's region of it."""
        if not self.piece_delta:
            raise MetadataError("a delta bucket arrived in an update that is not a delta")
        data = self._checked_bucket(staging, nbytes, checksum)
        end = _end(pieces)
        for piece in pieces:
            self._checked_piece(piece, end)
        for change in decode_bucket(pieces, self._metas, data):
            meta = self._metas[change.piece.tensor]
            box = change.piece.box
            regions = self._regions_of(meta.name, box, inside_kept=True)
            if change.whole is not None or change.index is not None:
                self._save(meta.name)
                dest = self._target.region(meta.name, box)
                if dest is None:
                    raise MetadataError(f"{meta.name!r}: the target offers no region of box "
                                        f"{box} to apply a delta to")
                self.touched = True
                if change.whole is not None:
                    self._watch(meta.name, change.whole.view(DTYPES[meta.dtype]))
                    dest.copy_(change.whole.view(DTYPES[meta.dtype]).view(box.lengths))
                else:
                    assert change.index is not None and change.values is not None
                    self._watch(meta.name, change.values.view(DTYPES[meta.dtype]))
                    at = torch.unravel_index(change.index.to(dest.device), box.lengths)
                    dest.view(BITS_VIEW[meta.itemsize])[at] = change.values.to(dest.device)
            self._arrived(meta.name, regions, box)
        self.bytes_received += nbytes

    def skip_pieces(self, pieces: Sequence[Piece]) -> None:
        """A delta bucket that does not travel (nothing in it changed): its pieces are as the
        target holds them."""
        if not self.piece_delta:
            raise MetadataError("an unchanged bucket in an update that is not a delta")
        end = _end(pieces)
        for piece in pieces:
            meta = self._checked_piece(piece, end)
            self._arrived(meta.name, self._regions_of(meta.name, piece.box, inside_kept=True),
                          piece.box)

    def _watch(self, name: str, values: torch.Tensor) -> None:
        """Hand what arrived of `name` (in its dtype) to the finite check, if on."""
        self._watch_all([(name, values)])

    def _watch_all(self, arrived: Sequence[tuple[str, torch.Tensor]]) -> None:
        """`_watch` each (name, values): on CUDA a few launches for all of them (one host call
        per tensor cost more than the device's reading); FP8 values are still bit-tested
        one by one."""
        if self.finite is not None and arrived:
            self.finite.watch_all(arrived)

    def _arrived(self, name: str, regions: _Regions, box: Box) -> None:
        regions.boxes.append(box)
        regions.received += box.numel
        if regions.received == regions.expected:
            del self._pending[name]
            del self._regions[name]

    def _save(self, name: str) -> None:
        """Keep `name`'s current value (once per update) before any byte of it changes, and
        of what writing it also changes (`WeightTarget.companions`)."""
        for companion in self._target.companions(name):
            self._save_one(companion)
        self._save_one(name)

    def _save_one(self, name: str) -> None:
        if self._store is not None and name not in self._saved:
            saved = self._target.snapshot(name, self._store.get(name))
            if saved is None:
                raise MetadataError(f"cannot keep a copy of {name!r} for rollback: the target "
                                    "offers no snapshot; turn rollback off for this target")
            self._store[name] = saved
            self._saved.add(name)

    def rollback(self) -> int:
        """Restore every tensor this update changed; returns how many were restored."""
        if not self._saved or self._store is None:
            return 0
        restored = [(name, self._store[name]) for name in sorted(self._saved)]
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)  # the saving copies and the backend's writes
        self._origin.restore(restored)
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
        self._saved.clear()
        self.touched = False
        return len(restored)

    def precheck(self, metas: Sequence[TensorMeta]) -> None:
        """Check `metas` (the list the receiver got last) against the target when an update opens,
        so an update naming that list moves bytes without checking it again. A refused list is not
        remembered: `announce` checks it again and names the problem."""
        try:
            self._target.check(metas)
        except Exception:  # announce raises it again, naming the update
            return
        self._prechecked = metas

    def announce(self, metas: Sequence[TensorMeta]) -> None:
        """Start a group of tensors; the target checks them all before anything is written
        (unless it did when the update opened: `precheck`)."""
        if self._pending:
            clash = [m.name for m in metas if m.name in self._pending]
            if clash:
                raise MetadataError(f"tensors announced again before they arrived: "
                                    f"{clash[:5]}")
        if metas is not self._prechecked:
            self._target.check(metas)
        self._metas = list(metas)
        self._listed = metas
        named = {m.name: m for m in metas}
        self._pending.update(named)
        self._announced.update(named)

    def announce_listed(self, manifests: Manifests, tensors: object,
                        tensors_digest: str | None) -> Manifest:
        """For a backend's `_receive`: the tensor list an update carries (or names by its
        digest, as `manifests` resolves it), announced (checked against the target before
        any byte lands)."""
        manifest = manifests.resolve(tensors, tensors_digest)
        if manifest is None:
            raise MetadataError("the update info must carry 'tensors' or 'tensors_digest'")
        self.announce(manifest.metas)
        return manifest

    def keep_planned(self, manifest: Manifest, published: dict[str, TensorLayout]) -> None:
        """For an M->N backend's `_receive`: of each tensor only what this worker keeps
        arrives (`WeightTarget.keeps`). Refuses (`MetadataError`, before any byte moves) a
        tensor it keeps now but did not `published` when the transfer was initialized: no
        trainer rank's plan sends it (LoRA adapters, named by each update)."""
        kept = self._origin.keeps()  # (the engine's target, also under a delta)
        sent = {m.name for m in manifest.metas}
        undeclared = sorted(n for n in (kept or {}) if n in sent and n not in published)
        if undeclared:
            raise MetadataError(f"this worker keeps {undeclared[:3]}, which it did not declare "
                                "when the M->N transfer was initialized, so no trainer rank "
                                "would send them; send such tensors over ipc, or without M->N")
        self.keep_only(kept)

    def keep_only(self, kept: dict[str, TensorLayout] | None) -> None:
        """An M->N update: of each announced tensor only what `kept` holds arrives (None:
        whole tensors, assembled from their boxes); tensors this worker keeps nothing of are
        complete at once."""
        self._kept = kept
        for name in list(self._pending):
            meta = self._pending[name]
            layout = kept.get(name) if kept is not None else None
            expected = layout.numel if layout is not None else meta.numel
            if kept is not None and layout is None:
                expected = 0
            if expected == 0:
                del self._pending[name]
            else:
                self._regions[name] = _Regions(expected)

    def consume_pieces(self, staging: torch.Tensor, nbytes: int, pieces: Sequence[Piece],
                       checksum: int | None = None, *, crop: bool = False) -> None:
        """Load one M->N bucket: each piece a box of an announced tensor at its offset in the
        first `nbytes` of uint8 `staging` (see the module docstring). With `crop`, the
        bucket is one every worker reads (shared staging) and only the parts of each box
        that this worker keeps are copied; without it, every piece must lie in what it keeps."""
        data = self._checked_bucket(staging, nbytes, checksum)
        context = self._program_context()
        key = PiecePrograms.key(staging, nbytes, pieces, crop) if context is not None else None
        if context is not None and key is not None and not self._unprogrammed:
            assert self._programs is not None
            program = self._programs.find(context, key)
            if program is not None and key[1:] not in self._replayed:
                self._replayed.add(key[1:])
                self._replay(program)
                self._programs.use(context, key, program)
                return
        self._unprogrammed = True
        loads: list[tuple[str, torch.Tensor]] = []
        arrived: list[tuple[str, torch.Tensor]] = []
        dests: list[torch.Tensor] = []
        sources: list[torch.Tensor] = []
        boxes: dict[str, list[Box]] = {}
        elements: dict[str, int] = {}
        assembles = False
        received = 0
        for piece in pieces:
            meta = self._checked_piece(piece, nbytes)
            src = data[piece.offset: piece.offset + piece.nbytes].view(
                DTYPES[meta.dtype]).view(piece.box.lengths)
            for box in self._kept_parts(meta.name, piece.box) if crop else [piece.box]:
                regions = self._regions_of(meta.name, box, inside_kept=not crop)
                self._save(meta.name)
                dest = self._target.region(meta.name, box)
                if dest is None:
                    assembles = True
                    if regions.full is None:
                        regions.full = torch.empty(meta.shape, dtype=DTYPES[meta.dtype],
                                                   device=self._device)
                    dest = regions.full[box.slices()]
                dests.append(dest)
                sources.append(src[box.slices_in(piece.box)] if crop else src)
                arrived.append((meta.name, sources[-1]))  # what this worker keeps is checked
                regions.boxes.append(box)
                regions.received += box.numel
                boxes.setdefault(meta.name, []).append(box)
                elements[meta.name] = elements.get(meta.name, 0) + box.numel
                received += box.numel * meta.itemsize
                if regions.received == regions.expected:
                    del self._pending[meta.name]
                    del self._regions[meta.name]
                    if regions.full is not None:
                        loads.append((meta.name, regions.full))
        if self.finite is not None:  # the whole bucket checked and copied in a few launches
            self.finite.watch_all(arrived)
        if dests:  # every piece checked: now the bytes change
            self.touched = True
            torch._foreach_copy_(dests, sources, non_blocking=True)
        if loads:
            self._target.load_weights(loads)
        self.bytes_received += received
        if context is not None and key is not None and not assembles:
            assert self._programs is not None
            self._programs.use(context, key, PieceProgram(sources, dests, arrived, boxes,
                                                          elements, received))

    def _program_context(self) -> ProgramContext | None:
        """This update's `ProgramContext` (found once), or None where programs are not kept:
        no store of them, a delta (its target wraps the engine's), a target whose storages
        move."""
        if self._context is None and self._programs is not None \
                and self._target is self._origin:
            storages = self._origin.regions_key()
            if storages is not None:
                self._context = ProgramContext(self._listed, self._kept, storages,
                                               self._origin.alternate_regions_key())
        return self._context

    def _replay(self, program: PieceProgram) -> None:
        """Consume a bucket by its program: the bookkeeping of its pieces, then its copies."""
        for name, count in program.elements.items():
            regions = self._regions.get(name)
            if regions is None:
                raise MetadataError(f"tensor {name!r}: this worker keeps none of it left to "
                                    "receive, yet a bucket of it arrived")
            self._save(name)
            regions.boxes.extend(program.boxes[name])
            regions.received += count
            if regions.received == regions.expected:
                del self._pending[name]
                del self._regions[name]
        if self.finite is not None:
            self.finite.watch_all(program.arrived)
        self._origin.written(program.elements)  # (views found by an earlier update)
        if program.dests:
            self.touched = True
            torch._foreach_copy_(program.dests, program.sources, non_blocking=True)
        self.bytes_received += program.nbytes

    def _checked_piece(self, piece: Piece, nbytes: int) -> TensorMeta:
        """The announced tensor of `piece`, after checking that the piece fits it and the
        `nbytes`-byte bucket."""
        if not 0 <= piece.tensor < len(self._metas):
            raise MetadataError(f"piece names tensor #{piece.tensor} but only "
                                f"{len(self._metas)} were announced")
        meta = self._metas[piece.tensor]
        if (not piece.box.within(meta.shape) or piece.offset < 0
                or piece.offset + piece.nbytes > nbytes or piece.offset % meta.itemsize
                or piece.nbytes != piece.box.numel * meta.itemsize):
            raise MetadataError(f"piece of {meta.name!r} (box {piece.box}, bytes "
                                f"[{piece.offset}, {piece.offset + piece.nbytes})) does not "
                                f"fit the tensor {list(meta.shape)} or the {nbytes}-byte bucket")
        return meta

    def _kept_parts(self, name: str, box: Box) -> list[Box]:
        """The parts of `box` of tensor `name` that this worker keeps."""
        if self._kept is None:
            return [box]
        layout = self._kept.get(name)
        if layout is None:
            return []
        return [part for kept in layout.boxes if (part := box.intersect(kept)) is not None]

    def _regions_of(self, name: str, box: Box, *, inside_kept: bool) -> _Regions:
        """What arrived so far of tensor `name`, after checking that none of `box` did (and,
        with `inside_kept`, that `box` lies in what this worker keeps)."""
        regions = self._regions.get(name)
        if regions is None:
            raise MetadataError(f"tensor {name!r}: this worker keeps none of it left "
                                f"to receive, yet box {box} arrived")
        layout = self._kept.get(name) if self._kept is not None else None
        if inside_kept and layout is not None and not any(
                box.inside(b) for b in layout.boxes):
            raise MetadataError(f"tensor {name!r}: box {box} lies outside what this "
                                "worker keeps")
        if any(box.overlaps(b) for b in regions.boxes):
            raise MetadataError(f"tensor {name!r}: elements of box {box} arrived "
                                "twice")
        return regions

    def _checked_bucket(self, staging: torch.Tensor, nbytes: int,
                        checksum: int | None) -> torch.Tensor:
        """The first `nbytes` of `staging`, after checking they fit and match `checksum`."""
        if not 0 <= nbytes <= staging.numel():
            raise MetadataError(f"bucket of {nbytes} bytes does not fit the "
                                f"{staging.numel()}-byte staging buffer")
        data = staging[:nbytes]
        if checksum is not None:
            actual = bucket_checksum(data)
            if actual != checksum:
                raise IntegrityError(f"bucket checksum mismatch: sender {checksum:#018x}, "
                                     f"received {actual:#018x}; the bytes were corrupted or "
                                     "overwritten before the receiver read them")
        return data

    def consume(
        self,
        staging: torch.Tensor,
        nbytes: int,
        slices: Sequence[Slice],
        checksum: int | None = None,
    ) -> None:
        """Load one bucket's slices from the first `nbytes` of uint8 `staging`."""
        data = self._checked_bucket(staging, nbytes, checksum)
        batch = _Batch()
        for s in slices:
            meta = self._slice_meta(s, nbytes)
            piece = data[s.offset : s.offset + s.nbytes]
            self._save(meta.name)  # once per tensor per update, whichever chunk comes first
            if meta.nbytes == 0:
                batch.loads.append((meta.name, torch.empty(
                    meta.shape, dtype=DTYPES[meta.dtype], device=self._device)))
                del self._pending[meta.name]
            elif s.tensor_offset == 0 and s.nbytes == meta.nbytes:
                self._place_whole(meta, s, piece, batch)
            else:
                self._place_partial(meta, s, piece, batch)
        if batch.direct or batch.dsts or batch.loads:
            self.touched = True
        self._copy_direct(batch)
        copy_bytes(batch.dsts, batch.srcs)
        self._watch_all(batch.arrived + [(meta.name, tensor_from_bytes(buffer, meta))
                                         for meta, buffer in batch.completed])
        for name, buffer in batch.assembled:
            meta = self._announced[name]
            batch.loads.append((name, tensor_from_bytes(buffer, meta)))
        if batch.loads:
            self._target.load_weights(batch.loads)
        self.bytes_received += nbytes

    def _direct(self, name: str) -> torch.Tensor | None:
        direct = self._target.direct_bytes(name)
        return direct if direct is not None and direct.device == self._device else None

    def _place_whole(self, meta: TensorMeta, s: Slice, piece: torch.Tensor,
                     batch: _Batch) -> None:
        if s.offset % meta.itemsize:
            raise MetadataError(f"tensor {meta.name!r} at offset {s.offset} is not "
                                f"aligned to its {meta.itemsize}-byte elements")
        del self._pending[meta.name]
        direct = self._direct(meta.name)
        if direct is not None:
            batch.direct.append((meta, direct, piece))
        else:
            batch.arrived.append((meta.name, tensor_from_bytes(piece, meta)))
            batch.loads.append((meta.name, tensor_from_bytes(piece, meta)))

    def _copy_direct(self, batch: _Batch) -> None:
        """A bucket's whole tensors that go straight into the target: each large one copied
        and checked in one read where the device can (`FiniteCheck.copies`), the rest left
        to the bucket's batched copies and check."""
        checked = (self.finite.copies(self._device, len(batch.direct))
                   if self.finite is not None and batch.direct else None)
        for meta, dst, src in batch.direct:
            if checked is None or not checked.add(meta.name, dst, src, DTYPES[meta.dtype]):
                batch.dsts.append(dst)
                batch.srcs.append(src)
                batch.arrived.append((meta.name, tensor_from_bytes(src, meta)))

    def _slice_meta(self, s: Slice, nbytes: int) -> TensorMeta:
        if s.tensor >= len(self._metas):
            raise MetadataError(f"slice names tensor #{s.tensor} but only "
                                f"{len(self._metas)} were announced")
        meta = self._metas[s.tensor]
        if s.offset + s.nbytes > nbytes:
            raise MetadataError(f"slice of {meta.name!r} at [{s.offset}, {s.offset + s.nbytes})"
                                f" lies outside the {nbytes}-byte bucket")
        if s.tensor_offset + s.nbytes > meta.nbytes:
            raise MetadataError(f"slice of {meta.name!r} ends at byte "
                                f"{s.tensor_offset + s.nbytes}, past its {meta.nbytes} bytes")
        if meta.name not in self._pending:
            raise MetadataError(f"tensor {meta.name!r} arrived twice in one update")
        return meta

    def _place_partial(self, meta: TensorMeta, s: Slice, piece: torch.Tensor,
                       batch: _Batch) -> None:
        part = self._partials.get(meta.name)
        if part is None:
            direct = self._direct(meta.name)
            buffer = direct if direct is not None else torch.empty(
                meta.nbytes, dtype=torch.uint8, device=self._device)
            part = self._partials[meta.name] = _Partial(buffer, direct is not None)
        start, end = s.tensor_offset, s.tensor_offset + s.nbytes
        if any(start < b and a < end for a, b in part.spans):
            raise MetadataError(f"tensor {meta.name!r}: bytes [{start}, {end}) arrived twice")
        part.spans.append((start, end))
        batch.dsts.append(part.buffer[s.tensor_offset : s.tensor_offset + s.nbytes])
        batch.srcs.append(piece)
        part.received += s.nbytes
        if part.received == meta.nbytes:
            del self._partials[meta.name]
            del self._pending[meta.name]
            batch.completed.append((meta, part.buffer))
            if not part.direct:
                batch.assembled.append((meta.name, part.buffer))

    def load_whole(self, sources: Sequence[torch.Tensor]) -> None:
        """Load every announced tensor from its own flat uint8 source (a zero-copy update: the
        sender's storage); a target that keeps parts of tensors (a TP worker) gets only those.
        Every source is checked before any copy; the last update's copies replay where valid."""
        if len(sources) != len(self._metas):
            raise MetadataError(f"{len(sources)} sources for {len(self._metas)} tensors")
        for meta, src in zip(self._metas, sources, strict=True):
            if src.numel() != meta.nbytes:
                raise MetadataError(f"source of {meta.name!r} holds {src.numel()} bytes, "
                                    f"not {meta.nbytes}")
            if meta.name not in self._pending:
                raise MetadataError(f"tensor {meta.name!r} arrived twice in one update")
        self._run_whole(self._whole_program(sources, self._plan_whole),
                        [meta.name for meta in self._metas])

    def load_boxes(self, arrivals: Sequence[BoxSource]) -> None:
        """Load every announced tensor from boxes of it, each from its own flat uint8 source (M->N
        read in place: the ranks' shards), covering each tensor exactly once; only what this
        worker keeps is copied. The copies replay while the same `arrivals` list comes back."""
        if self.bytes_received or self.touched:
            raise MetadataError("an update read in place carries every tensor, but part of "
                                "this update arrived already")
        program = self._whole_program(arrivals, self._plan_boxes)
        self._run_whole(program, [m.name for m in self._metas if m.name in self._pending])
        self._regions.clear()

    def _run_whole(self, program: WholeProgram, names: list[str]) -> None:
        """Queue a whole update's copies, which complete the tensors `names`."""
        pending = self._pending
        watch = list(program.watched)  # what the check reads after the copies
        for name in names:
            self._save(name)  # (rollback: every snapshot queued before any copy)
            del pending[name]
        self.touched = True  # (a queued copy may go out later: as good as made)
        if self._target is self._origin:  # (a kept program finds no view through it)
            self._origin.written(names)
        replayed = replay_copies(program, self._device, self.finite)
        watch += replayed if replayed is not None else self._copy_eagerly(program)
        program.runs += 1
        self._watch_all(watch)
        if program.loads:
            self._target.load_weights(program.loads)
        for meta, parts in program.assembled:  # (one full-size buffer at a time)
            full = torch.empty(meta.shape, dtype=DTYPES[meta.dtype], device=self._device)
            for box, values in parts:
                full[box.slices()].copy_(values, non_blocking=True)
            self._watch_all([(meta.name, values) for _, values in parts])
            self._target.load_weights([(meta.name, full)])
        self.bytes_received += program.nbytes

    def _copy_eagerly(self, program: WholeProgram) -> list[tuple[str, torch.Tensor]]:
        """Issue `program`'s copies one by one (large ones spread over streams by
        `CopyQueue`, checked as they copy where the device can); return what the finite
        check still has to read."""
        copies = CopyQueue(fenced=self._store is not None,  # (rollback copies go between)
                           streams=WHOLE_UPDATE_STREAMS)
        checked = (self.finite.copies(self._device, len(program.copies))
                   if self.finite is not None and program.copies else None)
        watch: list[tuple[str, torch.Tensor]] = []
        try:
            for name, dtype, dst, src in program.copies:
                if checked is None or not checked.add(name, dst, src, dtype):
                    watch.append((name, src.view(dtype)))
                    copies.add(dst, src)
        except BaseException:
            copies.abort()  # what follows (a rollback, a drain) comes after what went out
            raise
        copies.close()
        if program.strided_dests:
            torch._foreach_copy_(program.strided_dests, program.strided_sources,
                                 non_blocking=True)
        return watch

    def _whole_program(self, sources: Sequence[Any],
                       plan: Callable[[Any, dict[str, TensorLayout] | None], WholeProgram]
                       ) -> WholeProgram:
        """The copies of a whole update from `sources`: the last update's when it read the
        same sources into the same storages, else worked out by `plan` (and kept for the
        next)."""
        context = self._program_context()  # (its storages key covers what the target keeps)
        programs = self._programs
        if context is not None and programs is not None:
            found = programs.find_whole(context, sources)
            if found is not None:
                return found
        program = plan(sources, self._kept if self._kept is not None else self._crop_layouts())
        if programs is not None:
            if context is not None:
                programs.keep_whole(context, program)
            else:
                programs.drop_whole()
        return program

    def _crop_layouts(self) -> dict[str, TensorLayout] | None:
        """What the target keeps of each tensor where it offers views of those parts
        (`WeightTarget.region`), so a whole update copies only them; None: every tensor goes
        whole (a target without views, such as vLLM's, is not asked what it keeps)."""
        if type(self._target).region is WeightTarget.region:
            return None
        return self._target.keeps()

    def _plan_whole(self, sources: Sequence[torch.Tensor],
                    kept: dict[str, TensorLayout] | None) -> WholeProgram:
        """Where each tensor of a whole update goes: whole into the target's storage, only
        the parts this worker keeps (contiguous parts copied like whole tensors, strided
        ones in one multi-tensor copy; only what is kept is checked), or to `load_weights`."""
        program = WholeProgram(sources)
        for meta, src in zip(self._metas, sources, strict=True):
            name, dtype = meta.name, DTYPES[meta.dtype]
            direct = self._direct(name) if meta.nbytes else None
            parts = (self._kept_regions(name, kept)
                     if direct is None and kept is not None and meta.nbytes else None)
            if direct is not None:
                program.copies.append((name, dtype, direct, src))
                program.nbytes += meta.nbytes
            elif parts is not None:
                full = tensor_from_bytes(src, meta)
                for box, dest in parts:
                    add_copy(program, name, dtype, dest, full[box.slices()])
                    program.nbytes += box.numel * meta.itemsize
            else:
                values = (tensor_from_bytes(src, meta) if meta.nbytes else
                          torch.empty(meta.shape, dtype=dtype, device=self._device))
                if meta.nbytes:
                    program.watched.append((name, values))
                program.loads.append((name, values))
                program.nbytes += meta.nbytes
        return program

    def _plan_boxes(self, arrivals: Sequence[BoxSource],
                    kept: dict[str, TensorLayout] | None) -> WholeProgram:
        """Where each box of an update read in place goes (`wtransfer.receiver.boxes`)."""

        def destinations(meta: TensorMeta, box: Box
                         ) -> list[tuple[Box, torch.Tensor | None]]:
            parts = self._kept_regions(meta.name, kept) if kept is not None else None
            if parts is not None:
                return [(part, dest[part.slices_in(kept_box)]) for kept_box, dest in parts
                        if (part := box.intersect(kept_box)) is not None]
            direct = self._direct(meta.name) if meta.nbytes else None
            if direct is not None:
                return [(box, tensor_from_bytes(direct, meta)[box.slices()])]
            region = self._target.region(meta.name, box)
            if region is not None:
                return [(box, region)]
            layout = kept.get(meta.name) if kept is not None else None  # (no view: assembled)
            if layout is None or layout.is_whole:
                return [(box, None)]
            return [(part, None) for kept_box in layout.boxes
                    if (part := box.intersect(kept_box)) is not None]

        return plan_boxes(arrivals, self._metas, destinations)

    def _kept_regions(self, name: str, kept: dict[str, TensorLayout]
                      ) -> list[tuple[Box, torch.Tensor]] | None:
        """Each part of tensor `name` this worker keeps, with the target's view it goes to;
        None where the worker keeps it whole or the target offers no views (the whole tensor
        then goes to `load_weights`)."""
        layout = kept.get(name)
        if layout is None:
            return []  # (a worker that keeps none of it: nothing to copy)
        if layout.is_whole:
            return None
        parts = []
        for box in layout.boxes:
            dest = self._target.region(name, box)
            if dest is None:
                return None
            parts.append((box, dest))
        return parts

    def direct_destination(self, bucket: Bucket, device: torch.device) -> torch.Tensor:
        """Where a direct bucket's bytes should land on `device`: the target's own storage
        when it offers it there, else a temporary buffer of the tensor's size."""
        s = bucket.slices[0] if len(bucket.slices) == 1 else None
        meta = self._slice_meta(s, bucket.nbytes) if s is not None else None
        if s is None or meta is None or s.tensor_offset or s.nbytes != meta.nbytes:
            raise MetadataError("a direct bucket must carry exactly one whole tensor")
        direct = self._target.direct_bytes(meta.name)
        if direct is not None and direct.device == device:
            self._save(meta.name)
            self.touched = True  # the backend writes into the target's storage from here on
            return direct
        return torch.empty(meta.nbytes, dtype=torch.uint8, device=device)

    def direct_temporary_bytes(self, bucket: Bucket, device: torch.device) -> int:
        """Bytes `direct_destination` would allocate for a direct bucket on `device`: 0 when
        the target offers its own storage there, else the tensor's size."""
        meta = self._metas[bucket.slices[0].tensor]
        direct = self._target.direct_bytes(meta.name)
        return 0 if direct is not None and direct.device == device else meta.nbytes

    def complete_direct(self, bucket: Bucket, data: torch.Tensor) -> None:
        """Record a direct bucket that landed in `data` (from `direct_destination`)."""
        meta = self._metas[bucket.slices[0].tensor]
        del self._pending[meta.name]
        self.touched = True
        direct = self._target.direct_bytes(meta.name)
        if direct is None or direct.data_ptr() != data.data_ptr():
            self._save(meta.name)
            self._watch(meta.name, tensor_from_bytes(data, meta))
            self._target.load_weights([(meta.name, tensor_from_bytes(data, meta))])
        else:  # a backend may still be writing it (one-sided reads): checked at `finish`
            self._landed.append((meta, data))
        self.bytes_received += bucket.nbytes

    def finish(self) -> None:
        """Raise `IntegrityError` unless every announced tensor arrived whole, and
        `NonFiniteError` if one held a NaN or an infinity (unless the check is off)."""
        if self._pending:
            names = sorted(self._pending)
            raise IntegrityError(f"update incomplete: {len(names)} announced tensor(s) never "
                                 f"arrived whole, e.g. {names[:3]}")
        self._watch_all([(meta.name, tensor_from_bytes(data, meta))
                         for meta, data in self._landed])
        self._landed = []
        bad = self.finite.first_bad() if self.finite is not None else None
        if bad is not None:
            raise NonFiniteError(
                f"update refused before it went live: {bad!r} holds NaN or infinite values "
                "(a diverged trainer step?); the engine keeps its previous weights. A sender "
                "that means to send them sets allow_non_finite=True in its init info")
        if self._programs is not None:
            self._programs.update_finished()


def _end(pieces: Sequence[Piece]) -> int:
    """Where the last of `pieces` ends in their (full) bucket."""
    return max((p.offset + p.nbytes for p in pieces), default=0)

