"""The M->N plan: which bytes each trainer rank sends each engine worker, and when.

A pure, deterministic function of the tensor list, the layouts of the M trainer ranks (what
each holds: DTensor shards, replicas) and the layouts of the N workers (what each keeps), and
the bucket size. Each destination byte comes from exactly one source, directly (no rank ever
holds a tensor it does not keep): for every box a worker keeps, the source boxes that cover it
are intersected with it, and each intersection goes to the least-loaded rank holding it
(replicas share the load, ties to the lowest rank). Each (trainer rank, worker) pair's pieces
are packed in order into buckets of at most `bucket_bytes` (a piece too large is cut along its
leading dimensions), and every bucket gets a round: the static schedule both sides follow. In
one round a rank sends or receives at most one bucket, and a pair's buckets keep their order,
so ranks that post their rounds in order, a few ahead, never wait on each other in a circle.

Planned once per tensor list and layouts; both sides check it by `TransferPlan.digest`.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch

from wtransfer.errors import MetadataError
from wtransfer.manifest import Manifest
from wtransfer.packing import DEFAULT_ALIGN, DTYPES, TensorMeta
from wtransfer.records import Box, TensorLayout
from wtransfer.wire import digest


@dataclass(frozen=True)
class Piece:
    """One region of one tensor inside a bucket."""

    tensor: int
    """Index in the tensor list."""
    box: Box
    """The region, in the tensor's global coordinates."""
    offset: int
    """Where its bytes start in the bucket."""
    nbytes: int


@dataclass(frozen=True)
class PairBucket:
    """One bucket of one (trainer rank, worker) pair."""

    sender: int
    worker: int
    round: int
    """When it moves in the static schedule."""
    nbytes: int
    pieces: tuple[Piece, ...]

    @property
    def direct(self) -> bool:
        """Never: a pair bucket is always packed (from boxes of the sender's shards)."""
        return False


@dataclass(frozen=True)
class TransferPlan:
    """Every pair's buckets in schedule order (see the module docstring)."""

    senders: int
    workers: int
    buckets: tuple[PairBucket, ...]
    digest: str

    def of_sender(self, sender: int) -> list[PairBucket]:
        """The buckets `sender` sends, in round order."""
        return [b for b in self.buckets if b.sender == sender]

    def of_worker(self, worker: int) -> list[PairBucket]:
        """The buckets `worker` receives, in round order."""
        return [b for b in self.buckets if b.worker == worker]

    def bytes_to(self, worker: int) -> int:
        """Tensor bytes (padding excluded) `worker` receives."""
        return sum(p.nbytes for b in self.buckets if b.worker == worker for p in b.pieces)

    def bytes_from(self, sender: int) -> int:
        """Tensor bytes `sender` sends."""
        return sum(p.nbytes for b in self.buckets if b.sender == sender for p in b.pieces)

    @property
    def rounds(self) -> int:
        """How many rounds the schedule has."""
        return 1 + max((b.round for b in self.buckets), default=-1)

    @cached_property
    def _positions(self) -> dict[tuple[int, int], int]:
        return {(b.sender, b.round): i for i, b in enumerate(self.buckets)}

    def position(self, bucket: PairBucket) -> int:
        """`bucket`'s index in the whole plan: a number no other bucket of it has (a sender
        sends at most one bucket per round), e.g. to tag its message."""
        return self._positions[(bucket.sender, bucket.round)]

    def moved(self, sender: int) -> dict[str, Any]:
        """The `TransferStats` fields of what `sender` moves: its pair buckets, its bytes and
        every worker's."""
        return {"buckets": sum(1 for b in self.buckets if b.sender == sender),
                "sent_bytes": self.bytes_from(sender),
                "worker_bytes": [self.bytes_to(w) for w in range(self.workers)]}

    def check(self, digest: str | None) -> None:
        """Refuse an update whose trainer planned otherwise (`MetadataError`): it names a
        different digest (the ranks published different layouts or lists)."""
        if digest != self.digest:
            raise MetadataError(f"M->N plan mismatch: the trainer planned {digest!r}, this "
                                f"worker {self.digest!r} (the ranks published different "
                                "layouts); initialize the transfer again")

    def to_wire(self) -> dict[str, Any]:
        """Plain form (`from_wire` checks its digest)."""
        return {"senders": self.senders, "workers": self.workers, "digest": self.digest,
                "buckets": _buckets_wire(self.buckets)}

    @classmethod
    def from_wire(cls, data: Any) -> TransferPlan:
        """Parse a plan; `MetadataError` when malformed or its digest does not match."""
        try:
            buckets = tuple(PairBucket(int(s), int(w), int(r), int(n), _pieces(pieces))
                            for s, w, r, n, pieces in data["buckets"])
            plan = cls(int(data["senders"]), int(data["workers"]), buckets, str(data["digest"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise MetadataError(f"malformed M->N plan: {exc}") from None
        if digest(_buckets_wire(plan.buckets)) != plan.digest:
            raise MetadataError("the M->N plan does not match its digest")
        return plan


def _buckets_wire(buckets: Sequence[PairBucket]) -> list[Any]:
    return [[b.sender, b.worker, b.round, b.nbytes, pieces_to_wire(b.pieces)]
            for b in buckets]


def pieces_to_wire(pieces: Sequence[Piece]) -> list[Any]:
    """Pieces in plain form: ``[[tensor, offsets, lengths, offset, nbytes], ...]``."""
    return [[p.tensor, list(p.box.offsets), list(p.box.lengths), p.offset, p.nbytes]
            for p in pieces]


def _pieces(data: Any) -> tuple[Piece, ...]:
    return tuple(Piece(int(t), Box(offsets=tuple(int(i) for i in o),
                                   lengths=tuple(int(n) for n in ln)), int(off), int(nb))
                 for t, o, ln, off, nb in data)


def pieces_from_wire(data: Any) -> tuple[Piece, ...]:
    """Parse `pieces_to_wire`'s form; `MetadataError` when malformed."""
    try:
        return _pieces(data)
    except (TypeError, ValueError) as exc:
        raise MetadataError(f"malformed M->N pieces: {exc}") from None


@functools.lru_cache(maxsize=16384)  # (the plan, and so each box, is the same every update)
def runs(layout: TensorLayout, box: Box) -> tuple[tuple[int, int], ...]:
    """The contiguous byte runs ``(offset in the rank's local tensor, length)`` that hold
    global region `box` of a rank holding `layout`, in the box's row-major order (its packed
    order in a bucket)."""
    dtype = DTYPES[layout.dtype]
    itemsize = dtype.itemsize
    local = torch.empty(layout.local_shape, dtype=dtype, device="meta")
    view = layout.view(local, box)
    shape, strides = list(view.shape), list(view.stride())
    inner, expected = len(shape), 1
    while inner > 0 and (shape[inner - 1] == 1 or strides[inner - 1] == expected):
        expected *= shape[inner - 1]
        inner -= 1
    length = expected * itemsize
    start = int(view.storage_offset())
    return tuple(((start + sum(i * s for i, s in zip(index, strides, strict=False))) * itemsize,
                  length) for index in itertools.product(*(range(n) for n in shape[:inner])))


def _split(box: Box, itemsize: int, limit: int) -> list[Box]:
    """`box` cut into boxes of at most `limit` bytes along its leading dimensions."""
    if box.numel * itemsize <= limit or not box.lengths:
        return [box]
    dim = next((d for d, n in enumerate(box.lengths) if n > 1), None)
    if dim is None:
        return [box]
    row = box.numel // box.lengths[dim] * itemsize
    step = max(1, limit // row)
    out = []
    for start in range(0, box.lengths[dim], step):
        n = min(step, box.lengths[dim] - start)
        offsets, lengths = list(box.offsets), list(box.lengths)
        offsets[dim] += start
        lengths[dim] = n
        part = Box(offsets=tuple(offsets), lengths=tuple(lengths))
        out += _split(part, itemsize, limit) if n == 1 and row > limit else [part]
    return out


def plan_transfers(metas: Sequence[TensorMeta], sources: Sequence[dict[str, TensorLayout]],
                   dests: Sequence[dict[str, TensorLayout]], bucket_bytes: int,
                   align: int = DEFAULT_ALIGN) -> TransferPlan:
    """The plan moving `metas` from ranks holding `sources` to workers keeping `dests` (see
    the module docstring); `MetadataError` when some kept byte has no source, or the
    sources' boxes overlap without being the same box (two tilings of one tensor)."""
    load = [0] * len(sources)
    pieces: dict[tuple[int, int], list[tuple[int, Box, int]]] = {}
    held = _by_name(sources)
    kept = _by_name(dests)
    for index, meta in enumerate(metas):
        keepers = kept.get(meta.name)
        if not keepers:
            continue
        itemsize = DTYPES[meta.dtype].itemsize
        tiles = _tiles(meta, held.get(meta.name, []))
        for worker, dest in keepers:
            for box in dest.boxes:
                covered = 0
                for tile, holders in tiles:
                    region = box.intersect(tile)
                    if region is None or not region.numel:
                        continue
                    sender = min(holders, key=lambda s: (load[s], s))
                    load[sender] += region.numel * itemsize
                    pieces.setdefault((sender, worker), []).append((index, region, itemsize))
                    covered += region.numel
                if covered > box.numel:
                    raise MetadataError(f"{meta.name!r}: trainer ranks hold overlapping boxes "
                                        f"of box {box} (two different shardings of one "
                                        "tensor)")
                if covered != box.numel:
                    raise MetadataError(f"{meta.name!r}: worker {worker} keeps {box.numel} "
                                        f"elements of box {box}, the trainer ranks hold "
                                        f"{covered} of them")
    raw: list[tuple[int, int, int, list[Piece]]] = []
    for (sender, worker), items in sorted(pieces.items()):
        current: list[Piece] = []
        used = 0
        for index, region, itemsize in items:
            for part in _split(region, itemsize, bucket_bytes):
                nbytes = part.numel * itemsize
                start = -(-used // align) * align
                if current and start + nbytes > bucket_bytes:
                    raw.append((sender, worker, used, current))
                    current, start = [], 0
                current.append(Piece(index, part, start, nbytes))
                used = start + nbytes
        if current:
            raw.append((sender, worker, used, current))
    buckets = _schedule(raw)
    return TransferPlan(len(sources), len(dests), buckets, digest(_buckets_wire(buckets)))


def _by_name(ranks: Sequence[dict[str, TensorLayout]]
             ) -> dict[str, list[tuple[int, TensorLayout]]]:
    """For each tensor name, the ranks holding part of it and their layouts, in rank order."""
    out: dict[str, list[tuple[int, TensorLayout]]] = {}
    for rank, layouts in enumerate(ranks):
        for name, layout in layouts.items():
            out.setdefault(name, []).append((rank, layout))
    return out


def _tiles(meta: TensorMeta, holders: Sequence[tuple[int, TensorLayout]]
           ) -> list[tuple[Box, list[int]]]:
    """The distinct boxes the trainer ranks hold of one tensor, each with its holders."""
    tiles: dict[Box, list[int]] = {}
    for sender, layout in holders:
        if tuple(layout.shape) != tuple(meta.shape):
            raise MetadataError(f"{meta.name!r}: trainer rank {sender} holds a tensor of shape "
                                f"{list(layout.shape)}, the list says {list(meta.shape)}")
        for box in layout.boxes:
            tiles.setdefault(box, []).append(sender)
    boxes = list(tiles)
    if sum(b.numel for b in boxes) > math.prod(meta.shape):
        for i, a in enumerate(boxes):
            for b in boxes[i + 1:]:
                if a.intersect(b) is not None:
                    raise MetadataError(f"{meta.name!r}: trainer ranks hold overlapping boxes "
                                        f"{a} and {b} (two different shardings of one tensor)")
    return sorted(tiles.items(), key=lambda item: (item[0].offsets, item[0].lengths))


def _schedule(raw: list[tuple[int, int, int, list[Piece]]]) -> tuple[PairBucket, ...]:
    """Rounds for every bucket: the earliest where its sender and worker are both free and
    after its pair's previous bucket; buckets taken a bucket per pair at a time, pairs in
    diagonal order (worker - sender), so an all-to-all of equal pairs takes one round per
    pair of each rank (no rank idles while another has two pairs waiting)."""
    by_pair: dict[tuple[int, int], list[tuple[int, list[Piece]]]] = {}
    for sender, worker, nbytes, chunk in raw:
        by_pair.setdefault((sender, worker), []).append((nbytes, chunk))
    width = max([s + 1 for s, _ in by_pair] + [w + 1 for _, w in by_pair] + [1])
    order = sorted(by_pair, key=lambda pair: ((pair[1] - pair[0]) % width, pair))
    free_s: dict[int, int] = {}
    free_w: dict[int, int] = {}
    out = []
    depth = max((len(v) for v in by_pair.values()), default=0)
    for i in range(depth):
        for sender, worker in order:
            queue = by_pair[(sender, worker)]
            if i >= len(queue):
                continue
            start = max(free_s.get(sender, 0), free_w.get(worker, 0))
            free_s[sender] = free_w[worker] = start + 1
            nbytes, chunk = queue[i]
            out.append(PairBucket(sender, worker, start, nbytes, tuple(chunk)))
    return tuple(sorted(out, key=lambda b: (b.round, b.sender, b.worker)))


def layouts_to_wire(layouts: dict[str, TensorLayout]) -> list[Any]:
    """A rank's layouts in plain form: ``[[name, dtype, shape, [[offsets, lengths], ...],
    concat_dim, replica], ...]`` (what ranks publish to each other)."""
    return [[lay.name, lay.dtype, list(lay.shape),
             [[list(b.offsets), list(b.lengths)] for b in lay.boxes], lay.concat_dim,
             lay.replica] for lay in layouts.values()]


def layouts_from_wire(data: Any, where: str) -> dict[str, TensorLayout]:
    """Parse `layouts_to_wire`'s form; `MetadataError` naming `where` when malformed."""
    try:
        out = {}
        for name, dtype, shape, boxes, concat_dim, replica in data:
            if dtype not in DTYPES:
                raise ValueError(f"unknown dtype {dtype!r}")
            out[str(name)] = TensorLayout(
                name=str(name), dtype=str(dtype), shape=tuple(int(n) for n in shape),
                boxes=tuple(Box(offsets=tuple(int(o) for o in offs),
                                lengths=tuple(int(n) for n in lens)) for offs, lens in boxes),
                concat_dim=int(concat_dim), replica=int(replica))
        return out
    except (TypeError, ValueError) as exc:
        raise MetadataError(f"malformed layouts from {where}: {exc}") from None


LAYOUTS = "m2n_layouts"
"""The field of a trainer rank's init fragment that carries its layouts to the other ranks
(`fragment_with_layouts`, `planner_of`)."""


def fragment_with_layouts(fragment: dict[str, Any], layouts: dict[str, TensorLayout]
                          ) -> dict[str, Any]:
    """A trainer rank's init fragment carrying what it holds of each tensor."""
    return {**fragment, LAYOUTS: layouts_to_wire(layouts)}


def planner_of(fragments: list[dict[str, Any]], dests: list[dict[str, TensorLayout]] | None,
               bucket_bytes: int) -> tuple[Planner, list[dict[str, Any]]]:
    """The planner between the layouts every trainer rank's fragment carries (in sender
    order) and `dests`, and the fragments without the layouts."""
    sources = [layouts_from_wire(f.get(LAYOUTS), f"trainer rank {i}")
               for i, f in enumerate(fragments)]
    stripped = [{k: v for k, v in f.items() if k != LAYOUTS} for f in fragments]
    return Planner(sources, dests, bucket_bytes), stripped


def keeps_part(layouts: dict[str, TensorLayout]) -> bool:
    """Whether a worker holding `layouts` keeps less than every tensor whole (a TP or EP
    shard), so that sending it only what it keeps saves bytes."""
    return any(layout.boxes != (Box.whole(layout.shape),) for layout in layouts.values())


def whole_layouts(metas: Sequence[TensorMeta], replica: int = 0) -> dict[str, TensorLayout]:
    """Every tensor of `metas` held whole."""
    return {m.name: TensorLayout.whole(m.name, m.dtype, m.shape, replica=replica)
            for m in metas}


class Planner:
    """The plan of each tensor list (the last one kept: a trainer sends the same every step)
    between fixed layouts of the trainer ranks (`sources`) and of the workers (`dests`; None:
    one destination that keeps every tensor whole, as for staging every worker reads)."""

    def __init__(self, sources: list[dict[str, TensorLayout]],
                 dests: list[dict[str, TensorLayout]] | None, bucket_bytes: int) -> None:
        self.sources = sources
        self.dests = dests
        self.bucket_bytes = bucket_bytes
        self._last: tuple[Manifest, TransferPlan] | None = None

    def plan(self, manifest: Manifest) -> TransferPlan:
        """The plan moving `manifest`'s tensors."""
        if self._last is None or self._last[0] is not manifest:
            dests = self.dests if self.dests is not None else [whole_layouts(manifest.metas)]
            self._last = (manifest, plan_transfers(manifest.metas, self.sources, dests,
                                                   self.bucket_bytes))
        return self._last[1]
