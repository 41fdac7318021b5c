"""Deltas of an M->N transfer: each pair bucket carries only its pieces' changed elements.

Each trainer rank diffs its own shards: it keeps the bytes of every pair bucket it last sent
(`wtransfer.trainer.deltas.PairDeltaSender`, host memory by default) and, for a delta, compares
every piece of each of its buckets (its box of the rank's shard, where it lies) with the
bytes it last sent, by bits (as `wtransfer.delta.codec` compares whole tensors), and encodes
the bucket (`encode_bucket`)::

    one int32 per piece: -1 the piece travels whole, 0 it is unchanged, else how many of its
    elements changed; then, 8-aligned, each changed piece: whole, or the flat indices of its
    changed elements within the piece (uint16 for a piece of at most 65,536 elements, else
    int32), ascending, then their values

A bucket with no change does not travel (`UNCHANGED`); one whose encoding would take at least
half its bytes travels whole (`WHOLE`). What each bucket of the plan is (`UNCHANGED`, `WHOLE`
or its encoded length) is gathered from every rank into the update call (`delta_buckets`),
so each worker knows what it will receive before any byte moves. A worker applies a bucket's
pieces in place (`UpdateSession.consume_piece_delta`), into the regions of its target that
hold the base: so only targets that offer a writable region of everything they keep take
such deltas (`wtransfer.receiver.deltas.piece_delta_refusal`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from wtransfer.delta.codec import (
    BITS_VIEW,
    INDEX_DTYPES,
    bits,
    changed,
    index_dtype_for,
    sparse_limit,
)
from wtransfer.errors import MetadataError
from wtransfer.packing import DTYPES, TensorMeta
from wtransfer.transport.m2n import PairBucket, Piece, TransferPlan

UNCHANGED = 0
"""A bucket none of whose elements changed: it does not travel."""
WHOLE = -1
"""A bucket (or, in an encoding, a piece) that travels whole."""
_ALIGN = 8


def _up(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


@dataclass(frozen=True)
class EncodedBucket:
    """One pair bucket of a delta: what travels (`size`: `UNCHANGED`, `WHOLE` or the length
    of `data`) and how many of its elements changed."""

    size: int
    data: torch.Tensor | None
    changed: int


def encode_bucket(bucket: PairBucket, metas: Sequence[TensorMeta],
                  now_of: Callable[[Piece], torch.Tensor], last: torch.Tensor) -> EncodedBucket:
    """`bucket` as it travels in a delta (see the module docstring): `now_of(piece)` is a
    piece's values now (its box of the rank's shard, unpacked: nothing is packed to be
    compared), `last` the bytes the bucket last sent (uint8, on the device that compares),
    updated to now's where they changed."""
    counts: list[int] = []
    parts: list[torch.Tensor] = []
    total = moved = 0
    limit = bucket.nbytes // 2
    for number, piece in enumerate(bucket.pieces):
        itemsize = DTYPES[metas[piece.tensor].dtype].itemsize
        now = bits(now_of(piece).to(last.device))
        old = last[piece.offset: piece.offset + piece.nbytes].view(BITS_VIEW[itemsize])
        numel = piece.box.numel
        index_dtype = index_dtype_for(numel)
        index, count = changed(now, old, sparse_limit(numel, index_dtype, itemsize))
        total += count
        if count == 0:
            counts.append(0)
        elif index is None:
            counts.append(WHOLE)
            old.copy_(now)
            parts.append(old.view(torch.uint8))
            moved += _up(piece.nbytes)
        else:
            counts.append(count)
            values = now[index]
            old[index] = values
            parts += [index.to(INDEX_DTYPES[index_dtype]).view(torch.uint8),
                      values.view(torch.uint8)]
            moved += _up(count * INDEX_DTYPES[index_dtype].itemsize) + _up(count * itemsize)
        if moved > limit:  # the bucket goes whole: the rest of the copy follows unread
            for rest in bucket.pieces[number + 1:]:
                rest_size = DTYPES[metas[rest.tensor].dtype].itemsize
                last[rest.offset: rest.offset + rest.nbytes].view(BITS_VIEW[rest_size]).copy_(
                    bits(now_of(rest).to(last.device)))
            return EncodedBucket(WHOLE, None, -1)
    if total == 0:
        return EncodedBucket(UNCHANGED, None, 0)
    head = _up(4 * len(bucket.pieces))
    out = torch.zeros(head + moved, dtype=torch.uint8, device=last.device)
    out[: 4 * len(counts)] = torch.tensor(counts, dtype=torch.int32).view(torch.uint8)
    at = head
    for part in parts:
        out[at: at + part.numel()] = part
        at += _up(part.numel())
    return EncodedBucket(head + moved, out, total)


@dataclass(frozen=True)
class PieceChange:
    """What a delta bucket says of one piece: `whole` (its bytes), or `index` (int64 flat
    positions within the piece) and `values` (as the piece's bits); neither: unchanged."""

    piece: Piece
    whole: torch.Tensor | None = None
    index: torch.Tensor | None = None
    values: torch.Tensor | None = None


def decode_bucket(pieces: Sequence[Piece], metas: Sequence[TensorMeta], data: torch.Tensor
                  ) -> list[PieceChange]:
    """Each piece's change in an encoded bucket (uint8 `data`), after checking that the
    encoding has exactly its length and every index lies in its piece, ascending, once."""
    head = _up(4 * len(pieces))
    if data.numel() < head:
        raise MetadataError(f"a delta bucket of {data.numel()} bytes cannot hold the counts of "
                            f"its {len(pieces)} pieces")
    counts = data[: 4 * len(pieces)].clone().view(torch.int32).tolist()
    out, at = [], head
    for piece, count in zip(pieces, counts, strict=True):
        meta = metas[piece.tensor]
        itemsize, numel = DTYPES[meta.dtype].itemsize, piece.box.numel
        if not -1 <= count <= numel:
            raise MetadataError(f"a delta of {meta.name!r}: {count} changed elements of a "
                                f"piece of {numel}")
        if count == 0:
            out.append(PieceChange(piece))
            continue
        index_dtype = INDEX_DTYPES[index_dtype_for(numel)]
        ends = ([at + piece.nbytes] if count == WHOLE else
                [at + count * index_dtype.itemsize,
                 at + _up(count * index_dtype.itemsize) + count * itemsize])
        if ends[-1] > data.numel():
            raise MetadataError(f"a delta bucket of {data.numel()} bytes ends inside its "
                                f"piece of {meta.name!r}")
        if count == WHOLE:
            out.append(PieceChange(piece, whole=data[at: ends[0]]))
            at = _up(ends[0])
            continue
        index = data[at: ends[0]].clone().view(index_dtype).to(torch.int64)
        values = data[_up(ends[0]): ends[1]].clone().view(BITS_VIEW[itemsize])
        at = _up(ends[1])
        if int(index[0]) < 0 or int(index[-1]) >= numel \
                or bool((index[1:] <= index[:-1]).any()):
            raise MetadataError(f"a delta of {meta.name!r}: its {count} indices must ascend "
                                f"within the piece's {numel} elements")
        out.append(PieceChange(piece, index=index, values=values))
    if at != data.numel():
        raise MetadataError(f"a delta bucket of {data.numel()} bytes encodes {at}")
    return out


def gathered_sizes(plan: TransferPlan, reports: Sequence[object]) -> list[int]:
    """Every bucket's `EncodedBucket.size` in a delta, by its place in the plan, from every
    rank's report (``[[position, size], ...]`` of its own buckets; a rank that sends nothing
    reports none)."""
    sizes = [WHOLE] * len(plan.buckets)
    for report in reports:
        for position, size in report or ():  # type: ignore[attr-defined]
            sizes[int(position)] = int(size)
    return sizes
