"""The copies of an M->N bucket, worked out once and replayed by later updates.

An M->N plan is fixed while the tensor list and the layouts stay: every update a worker gets
the same buckets, with the same pieces, in the same staging buffers, bound for the same regions
of its weights. Checking each piece, cropping it to what the worker keeps and finding its
destination cost tens of microseconds of Python per piece (`benchmarks/apply_overhead.py`);
a `PieceProgram` is the outcome (the copies' sources and destinations, the boxes each tensor
gets, the bytes), and `PiecePrograms` keeps them across updates.

A program is replayed only where replaying it is exactly what the checks would allow: the
programs kept are the buckets of the last update that finished into the same storages (one
set, checked disjoint and complete as a whole), each bucket's pieces are replayed at most
once per update, an update that consumed a bucket without a program replays none after it
(that bucket was checked against what came before it, not against what a replay would add),
and a delta replays nothing.
Everything a program names must stay put: the tensor list, what the worker keeps, the
target's storages (`WeightTarget.regions_key`; None for a target that cannot tell, which
keeps nothing) and the staging buffer; the receiver drops them all when its sender or
staging changes. A swap-staged engine writes into two sets of storages in turn: programs
are kept for its present set and the other one (`WeightTarget.alternate_regions_key`), and
a replay tells the target what it writes (`WeightTarget.written`).

A zero-copy update (every tensor read whole from the sender's memory) has one program, a
`WholeProgram`: where each tensor, or each part a TP worker keeps, goes. It is kept as soon as
it is worked out (it depends on no earlier bucket: every update still checks each source's
size and that no tensor arrives twice) and replayed while the update reads the very same
list of sources (`wtransfer_ipc.zero_copy` makes a new one whenever a storage, the layout or
the tensor list changes) into the same target storages; a miss drops those made from other
sources.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from wtransfer.packing import TensorMeta
from wtransfer.records import Box
from wtransfer.transport.m2n import Piece


@dataclass(frozen=True)
class PieceProgram:
    """One bucket's copies for one worker (see the module docstring)."""

    sources: list[torch.Tensor]
    """Views of the staging buffer, one per copy."""
    dests: list[torch.Tensor]
    """The target's regions they go to."""
    arrived: list[tuple[str, torch.Tensor]]
    """(tensor name, source) of each copy, for the finite check."""
    boxes: dict[str, list[Box]]
    """The boxes each tensor gets."""
    elements: dict[str, int]
    """The elements each tensor gets."""
    nbytes: int
    """Tensor bytes the bucket delivers to this worker."""


@dataclass
class WholeProgram:
    """A whole update's copies for one worker (a zero-copy update: every tensor read from the
    sender's memory), worked out once and replayed while it reads the same `sources` into
    the same storages."""

    sources: Sequence[object]
    """The very list of sources it was worked out for (flat tensors, or the boxes of
    `wtransfer.receiver.boxes`)."""
    copies: list[tuple[str, torch.dtype, torch.Tensor, torch.Tensor]] = field(
        default_factory=list)
    """(tensor name, dtype, destination bytes, source bytes): whole tensors and contiguous
    parts, checked in their copy where the device can."""
    strided_dests: list[torch.Tensor] = field(default_factory=list)
    """Strided parts' destinations, copied in one multi-tensor call."""
    strided_sources: list[torch.Tensor] = field(default_factory=list)
    """Their sources."""
    watched: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    """(name, values) the batched finite check reads: strided parts, tensors loaded whole."""
    loads: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    """Tensors handed to `WeightTarget.load_weights` (the target offers no view)."""
    nbytes: int = 0
    """Tensor bytes this worker receives."""
    assembled: list[tuple[TensorMeta, list[tuple[Box, torch.Tensor]]]] = field(
        default_factory=list)
    """Tensors the target offers no view of, each with the parts of it this worker keeps
    and their sources: assembled one at a time in a full-size buffer and loaded."""
    runs: int = 0
    """Updates that ran it so far."""
    graph: object | None = None
    """Its copies captured as one CUDA graph (`wtransfer.receiver.copy_graph`), once
    replayed."""
    graph_failed: bool = False
    """Whether capturing them failed or could not be done (they stay eager)."""


ProgramKey = tuple[int, int, tuple[Piece, ...], bool]
"""(staging address, bucket bytes, pieces, crop)."""


KEPT_SETS = 2
"""Sets of target storages programs are kept for (a swap-staged engine alternates two)."""


@dataclass(frozen=True)
class ProgramContext:
    """What every program of an update names besides its bucket: the tensor list and the
    layouts (the same objects, update after update, while they stay) and the target's
    storages (`WeightTarget.regions_key`)."""

    metas: object
    kept: object
    storages: Hashable
    alternate: Hashable | None = None
    """The storages key after the target's next commit where commits alternate two sets
    (`WeightTarget.alternate_regions_key`): programs made for it are kept too."""

    def same(self, other: ProgramContext | None) -> bool:
        """Whether programs made under `other` hold under this one."""
        return (other is not None and other.metas is self.metas and other.kept is self.kept
                and other.storages == self.storages)


class PiecePrograms:
    """The programs of the last finished M->N update, for the updates after it, and the last
    zero-copy update's (see the module docstring), for each of the last `KEPT_SETS` sets of
    target storages; owned by a receiver, which drops them with its staging."""

    def __init__(self) -> None:
        self._kept: list[tuple[ProgramContext, dict[ProgramKey, PieceProgram]]] = []
        """Newest first: each storage set's bucket programs."""
        self._used: dict[ProgramKey, PieceProgram] = {}
        """The open update's programs, replayed or worked out."""
        self._used_context: ProgramContext | None = None
        self._whole: list[tuple[ProgramContext, WholeProgram]] = []
        """Newest first: each storage set's last zero-copy update's copies."""

    @staticmethod
    def key(staging: torch.Tensor, nbytes: int, pieces: Sequence[Piece],
            crop: bool) -> ProgramKey:
        """What a bucket's program is kept under."""
        return (staging.data_ptr(), nbytes, tuple(pieces), crop)

    def find(self, context: ProgramContext, key: ProgramKey) -> PieceProgram | None:
        """The program kept for `key` under `context`, or None."""
        self._kept = _alike(self._kept, context)
        for made_under, programs in self._kept:
            if context.same(made_under):
                return programs.get(key)
        return None

    def use(self, context: ProgramContext, key: ProgramKey, program: PieceProgram) -> None:
        """Note a program the open update replayed or worked out."""
        if not context.same(self._used_context):
            self._used = {}
            self._used_context = context
        self._used[key] = program

    def update_finished(self) -> None:
        """The open update finished: its buckets are what the next updates replay."""
        context = self._used_context
        if context is not None:
            others = [(c, p) for c, p in _alike(self._kept, context) if not context.same(c)]
            self._kept = [(context, self._used), *others][:KEPT_SETS]
        self._used, self._used_context = {}, None

    def update_started(self) -> None:
        """An update opens: what an unfinished one used is not kept (the programs kept stay
        those of the last finished one)."""
        self._used, self._used_context = {}, None

    def find_whole(self, context: ProgramContext, sources: Sequence[object]
                   ) -> WholeProgram | None:
        """The whole update's program made under `context` from these very `sources`, or
        None."""
        self._whole = [(c, p) for c, p in _alike(self._whole, context) if p.sources is sources]
        for made_under, program in self._whole:
            if context.same(made_under):
                return program
        return None

    def drop_whole(self) -> None:
        """Forget the zero-copy programs (an update that cannot keep one: their views would
        hold storages nothing reads)."""
        self._whole = []

    def keep_whole(self, context: ProgramContext, program: WholeProgram) -> None:
        """Keep a whole update's program for the next updates into the same storages."""
        others = [(c, p) for c, p in _alike(self._whole, context) if not context.same(c)]
        self._whole = [(context, program), *others][:KEPT_SETS]

    def whole_programs(self) -> list[WholeProgram]:
        """The whole-update programs kept, newest first."""
        return [program for _, program in self._whole]

    def clear(self) -> None:
        """Drop every program (the staging is unmapped, or the sender changed)."""
        self._kept = []
        self._whole = []
        self.update_started()


T = TypeVar("T")


def _alike(kept: list[tuple[ProgramContext, T]], context: ProgramContext
           ) -> list[tuple[ProgramContext, T]]:
    """The entries of `kept` made for `context`'s tensor list and layouts, into its storages
    or their alternate set: the others hold views nothing will read again."""
    return [(c, p) for c, p in kept if c.metas is context.metas and c.kept is context.kept
            and c.storages in (context.storages, context.alternate)]
