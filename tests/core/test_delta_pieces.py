"""Deltas of M->N pair buckets on real tensors: a bucket of pieces of several dtypes encodes
each piece whole, sparse or not at all, decodes back to exactly the new bytes, goes whole when
the encoding would not save half, and malformed encodings are refused by name."""

import pytest
import torch

from wtransfer.delta.codec import bits
from wtransfer.delta.pieces import UNCHANGED, WHOLE, decode_bucket, encode_bucket
from wtransfer.errors import MetadataError
from wtransfer.packing import DTYPES, TensorMeta
from wtransfer.records import Box
from wtransfer.transport.m2n import plan_transfers, whole_layouts

METAS = [TensorMeta("a", "bfloat16", (64, 48)), TensorMeta("b", "float32", (300,)),
         TensorMeta("c", "int8", (5, 7)), TensorMeta("d", "float8_e4m3fn", (128,))]


def bucket_of(metas=METAS):
    """The one pair bucket of a worker keeping rows 8..40 of `a` and all of the rest."""
    dest = whole_layouts(metas)
    dest["a"] = dest["a"].__class__(name="a", dtype="bfloat16", shape=(64, 48),
                                    boxes=(Box(offsets=(8, 0), lengths=(32, 48)),))
    plan = plan_transfers(metas, [whole_layouts(metas)], [dest], 1 << 20)
    (bucket,) = plan.buckets
    return bucket


def packed(bucket, gen):
    return torch.randint(0, 256, (bucket.nbytes,), generator=gen, dtype=torch.uint8)


def values_in(data):
    """A piece's values in packed bucket bytes `data` (what a rank's shard holds now)."""
    return lambda piece: data[piece.offset: piece.offset + piece.nbytes].view(
        DTYPES[METAS[piece.tensor].dtype]).view(piece.box.lengths)


def piece_bytes(bucket, data, name):
    (piece,) = [p for p in bucket.pieces if METAS[p.tensor].name == name]
    return piece, data[piece.offset: piece.offset + piece.nbytes]


def test_a_bucket_round_trips_with_each_piece_sparse_whole_or_unchanged():
    gen = torch.Generator().manual_seed(0)
    bucket = bucket_of()
    last = packed(bucket, gen)
    now = last.clone()
    for name, flips in (("a", 7), ("b", 300), ("d", 1)):  # "c" unchanged, "b" all changed
        view = piece_bytes(bucket, now, name)[1]
        elements = bits(view.view({"a": torch.bfloat16, "b": torch.float32,
                                   "d": torch.uint8}[name]))
        elements[torch.randperm(elements.numel(), generator=gen)[:flips]] ^= 1
    copy = last.clone()
    encoded = encode_bucket(bucket, METAS, values_in(now), copy)
    assert torch.equal(copy, now)  # the last-sent copy follows where it changed
    assert 0 < encoded.size < bucket.nbytes // 2 and encoded.changed == 7 + 300 + 1
    changes = {METAS[c.piece.tensor].name: c for c in decode_bucket(bucket.pieces, METAS,
                                                                    encoded.data)}
    assert changes["c"].whole is None and changes["c"].index is None  # unchanged
    assert torch.equal(changes["b"].whole, piece_bytes(bucket, now, "b")[1])  # whole
    for name, width in (("a", torch.int16), ("d", torch.uint8)):
        view = piece_bytes(bucket, now, name)[1]
        rebuilt = piece_bytes(bucket, last, name)[1].clone().view(width)
        rebuilt[changes[name].index] = changes[name].values
        assert torch.equal(rebuilt.view(torch.uint8), view)
        assert changes[name].index.numel() == (7 if name == "a" else 1)


def test_an_unchanged_bucket_does_not_travel_and_a_mostly_changed_one_goes_whole():
    gen = torch.Generator().manual_seed(1)
    bucket = bucket_of()
    last = packed(bucket, gen)
    assert encode_bucket(bucket, METAS, values_in(last.clone()), last.clone()).size == UNCHANGED
    other = packed(bucket, gen)
    copy = last.clone()
    assert encode_bucket(bucket, METAS, values_in(other), copy).size == WHOLE
    assert all(torch.equal(copy[p.offset: p.offset + p.nbytes],
                           other[p.offset: p.offset + p.nbytes])
               for p in bucket.pieces)  # the copy follows (padding is never compared)


@pytest.mark.parametrize(("damage", "error"), [
    (lambda d: d[:-8], "ends inside its piece of 'a'"),
    (lambda d: torch.cat([d, torch.zeros(8, dtype=torch.uint8)]), "encodes"),
    (lambda d: d[:4], "cannot hold the counts"),
    ("count", "changed elements of a piece"),
    ("order", "must ascend"),
])
def test_malformed_delta_buckets_are_refused(damage, error):
    gen = torch.Generator().manual_seed(2)
    bucket = bucket_of()
    last = packed(bucket, gen)
    now = last.clone()
    piece, view = piece_bytes(bucket, now, "a")
    bits(view.view(torch.bfloat16))[torch.tensor([3, 90])] ^= 1
    data = encode_bucket(bucket, METAS, values_in(now), last.clone()).data.clone()
    at = bucket.pieces.index(piece)
    if damage == "count":  # more changed elements than the piece has
        data[4 * at: 4 * at + 4] = torch.tensor([10**6], dtype=torch.int32).view(torch.uint8)
    elif damage == "order":  # the two indices swapped
        head = -(-4 * len(bucket.pieces) // 8) * 8
        data[head: head + 4] = data[head: head + 4].clone().view(-1, 2).flip(0).reshape(-1)
    else:
        data = damage(data)
    with pytest.raises(MetadataError, match=error):
        decode_bucket(bucket.pieces, METAS, data)
