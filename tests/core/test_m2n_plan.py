"""The M->N plan: a pure function, checked by carrying real tensors through it.

Sources are row shards (FSDP2's, uneven) and replicas; destinations are what tensor-parallel
workers keep (rows, columns, and a fused tensor kept as two boxes side by side). Executing the
plan (pack each pair bucket from the senders' local tensors, unpack into the workers' local
tensors) must give every worker exactly its part of every full tensor.
"""

import pytest
import torch

from wtransfer.errors import MetadataError
from wtransfer.packing import TensorMeta
from wtransfer.receiver.session import UpdateSession
from wtransfer.receiver.target import ModuleTarget
from wtransfer.records import Box, TensorLayout
from wtransfer.transport.m2n import (
    TransferPlan,
    layouts_from_wire,
    layouts_to_wire,
    plan_transfers,
)

FULL = {"embed": torch.randn(10, 6), "fused": torch.randn(8, 4), "down": torch.randn(4, 9),
        "norm": torch.randn(5)}
METAS = [TensorMeta.of(n, t) for n, t in FULL.items()]


def rows(name, start, stop, dim=0, replica=0):
    shape = tuple(FULL[name].shape)
    offsets, lengths = [0] * len(shape), list(shape)
    offsets[dim], lengths[dim] = start, stop - start
    return TensorLayout(name=name, dtype="float32", shape=shape,
                        boxes=(Box(offsets=tuple(offsets), lengths=tuple(lengths)),),
                        replica=replica)


def whole(name, replica=0):
    return TensorLayout.whole(name, "float32", FULL[name].shape, replica=replica)


def fsdp(ranks):
    """Row shards as FSDP2 cuts them (torch.chunk: the last ones shorter, or empty)."""
    out = []
    for r in range(ranks):
        held = {}
        for name, tensor in FULL.items():
            chunk = -(-tensor.shape[0] // ranks)
            a, b = min(r * chunk, tensor.shape[0]), min((r + 1) * chunk, tensor.shape[0])
            held[name] = rows(name, a, b)
        out.append(held)
    return out


def tp(rank):
    """A TP=2 worker: embedding rows, fused gate|up rows as two boxes, down columns."""
    fused = TensorLayout(name="fused", dtype="float32", shape=(8, 4), boxes=(
        Box(offsets=(2 * rank, 0), lengths=(2, 4)), Box(offsets=(4 + 2 * rank, 0),
                                                        lengths=(2, 4))))
    return {"embed": rows("embed", 5 * rank, 5 * rank + 5), "fused": fused,
            "down": rows("down", 4 * rank, 4 + 5 * rank, dim=1),  # columns 0..4, 4..9
            "norm": whole("norm", replica=rank)}


def execute(plan, sources, dests):
    """Carry the full tensors through the plan; each worker's local tensors."""
    local_src = [{n: lay.take(FULL[n]).clone() for n, lay in held.items()} for held in sources]
    local_dst = [{n: torch.full(lay.local_shape, float("nan")) for n, lay in kept.items()}
                 for kept in dests]
    for bucket in plan.buckets:
        data = torch.zeros(bucket.nbytes, dtype=torch.uint8)
        for p in bucket.pieces:
            name = METAS[p.tensor].name
            region = sources[bucket.sender][name].view(local_src[bucket.sender][name], p.box)
            data[p.offset:p.offset + p.nbytes].view(torch.float32).view(p.box.lengths).copy_(
                region)
        for p in bucket.pieces:
            name = METAS[p.tensor].name
            dests[bucket.worker][name].view(local_dst[bucket.worker][name], p.box).copy_(
                data[p.offset:p.offset + p.nbytes].view(torch.float32).view(p.box.lengths))
    return local_dst


@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
def test_every_worker_gets_exactly_its_part_of_every_tensor(ranks):
    sources, dests = fsdp(ranks), [tp(0), tp(1)]
    plan = plan_transfers(METAS, sources, dests, bucket_bytes=256)
    got = execute(plan, sources, dests)
    for kept, local in zip(dests, got, strict=True):
        for name, lay in kept.items():
            assert torch.equal(local[name], lay.take(FULL[name])), name
    for worker, kept in enumerate(dests):  # the bytes it keeps, no more
        assert plan.bytes_to(worker) == sum(lay.numel * 4 for lay in kept.values())
    assert sum(plan.bytes_from(s) for s in range(ranks)) == sum(plan.bytes_to(w)
                                                               for w in range(2))


def test_buckets_are_bounded_aligned_and_each_rank_moves_one_per_round():
    plan = plan_transfers(METAS, fsdp(3), [tp(0), tp(1)], bucket_bytes=256)
    seen = {}
    for b in plan.buckets:
        assert b.nbytes <= 256
        assert all(p.offset % 256 == 0 or p.offset % 4 == 0 for p in b.pieces)
        for key in (("s", b.sender, b.round), ("w", b.worker, b.round)):
            assert key not in seen, f"{key} moves two buckets in one round"
            seen[key] = b
    # a pair's buckets keep their order: its tensors' pieces come in list order
    for s in range(3):
        for w in range(2):
            order = [p.tensor for b in plan.buckets if (b.sender, b.worker) == (s, w)
                     for p in b.pieces]
            assert order == sorted(order)


def test_replicas_share_the_load():
    sources = [{n: whole(n, replica=r) for n in FULL} for r in range(2)]
    plan = plan_transfers(METAS, sources, [tp(0), tp(1)], bucket_bytes=1 << 16)
    sent = [plan.bytes_from(s) for s in range(2)]
    assert min(sent) > 0
    assert abs(sent[0] - sent[1]) <= max(t.numel() * 4 for t in FULL.values())


def test_the_plan_is_deterministic_and_travels_checked_by_its_digest():
    args = (METAS, fsdp(2), [tp(0), tp(1)], 256)
    plan = plan_transfers(*args)
    assert plan_transfers(*args).digest == plan.digest
    assert TransferPlan.from_wire(plan.to_wire()) == plan
    wire = plan.to_wire()
    wire["buckets"][0][4][0][3] += 4  # one piece moved by one element
    with pytest.raises(MetadataError, match="does not match its digest"):
        TransferPlan.from_wire(wire)
    with pytest.raises(MetadataError, match="malformed M->N plan"):
        TransferPlan.from_wire({"senders": 1})
    layouts = tp(1)
    assert layouts_from_wire(layouts_to_wire(layouts), "rank 1") == layouts
    with pytest.raises(MetadataError, match="malformed layouts from rank 3"):
        layouts_from_wire([["x", "float99", [1], [[[0], [1]]], 0, 0]], "rank 3")


def test_bytes_no_rank_holds_and_two_tilings_of_one_tensor_are_refused():
    partial = fsdp(2)
    del partial[1]["embed"]
    with pytest.raises(MetadataError, match=r"'embed': worker 1 keeps 30 elements .* hold 0"):
        plan_transfers(METAS, partial, [tp(0), tp(1)], 256)
    crossed = fsdp(2)
    crossed[1]["embed"] = rows("embed", 0, 3, dim=1)
    with pytest.raises(MetadataError, match="overlapping boxes"):
        plan_transfers(METAS, crossed, [tp(0), tp(1)], 256)


def test_a_receiver_refuses_pieces_outside_what_it_keeps_or_twice():
    module = torch.nn.Linear(4, 2, bias=False)
    target = ModuleTarget(module)
    meta = TensorMeta.of("weight", module.weight)
    kept = {"weight": TensorLayout(name="weight", dtype="float32", shape=(2, 4),
                                   boxes=(Box(offsets=(0, 0), lengths=(1, 4)),))}
    from wtransfer.transport.m2n import Piece

    data = torch.zeros(64, dtype=torch.uint8)
    session = UpdateSession(target, "cpu")
    session.announce([meta])
    session.keep_only(kept)
    outside = Piece(0, Box(offsets=(1, 0), lengths=(1, 4)), 0, 16)
    with pytest.raises(MetadataError, match="outside what this worker keeps"):
        session.consume_pieces(data, 16, [outside])
    half = Piece(0, Box(offsets=(0, 0), lengths=(1, 2)), 0, 8)
    session.consume_pieces(data, 16, [half])
    with pytest.raises(MetadataError, match="arrived twice"):
        session.consume_pieces(data, 16, [half])
    with pytest.raises(MetadataError, match="does not fit"):
        session.consume_pieces(data, 8, [Piece(0, Box(offsets=(0, 2), lengths=(1, 2)), 4, 8)])
    session.consume_pieces(data, 16, [Piece(0, Box(offsets=(0, 2), lengths=(1, 2)), 8, 8)])
    session.finish()  # every element it keeps arrived
    assert torch.equal(module.weight[0], torch.zeros(4))


def test_a_worker_reading_shared_staging_copies_only_what_it_keeps():
    """`crop`: a staged box spans what two workers keep; each copies only its own part (its
    bytes received are what it keeps), the values land where they belong, and a second
    arrival of a kept element or a piece that does not fit the bucket is refused."""
    from wtransfer.transport.m2n import Piece

    values = torch.arange(16, dtype=torch.float32).reshape(4, 4)
    staged = torch.zeros(64, dtype=torch.uint8)
    staged[:48].view(torch.float32).copy_(values[1:].flatten())
    whole_box = Piece(0, Box(offsets=(1, 0), lengths=(3, 4)), 0, 48)  # rows 1..3, not at
    # the origin: a part's place in the staged box differs from its place in the tensor
    for first, count in ((1, 1), (2, 2)):  # worker 0 keeps row 1, worker 1 rows 2..3
        module = torch.nn.Linear(4, 4, bias=False)
        session = UpdateSession(ModuleTarget(module), "cpu")
        session.announce([TensorMeta.of("weight", module.weight)])
        session.keep_only({"weight": TensorLayout(
            name="weight", dtype="float32", shape=(4, 4),
            boxes=(Box(offsets=(first, 0), lengths=(count, 4)),))})
        with pytest.raises(MetadataError, match="does not fit"):
            session.consume_pieces(staged, 40, [whole_box], crop=True)
        session.consume_pieces(staged, 48, [whole_box], crop=True)
        assert session.bytes_received == count * 16
        with pytest.raises(MetadataError, match="keeps none of it left"):
            session.consume_pieces(staged, 48, [whole_box], crop=True)
        session.finish()
        assert torch.equal(module.weight.detach()[first:first + count],
                           values[first:first + count])


def test_box_overlap_and_containment_agree_with_their_intersection():
    """`Box.overlaps` and `Box.inside` (the receiver's per-piece checks) answer as building
    the intersection would, empty boxes included."""
    import random

    rng = random.Random(0)
    for _ in range(5000):
        dims = rng.randint(1, 3)
        a, b = (Box(offsets=tuple(rng.randint(0, 6) for _ in range(dims)),
                    lengths=tuple(rng.randint(0, 5) for _ in range(dims))) for _ in range(2))
        common = a.intersect(b)
        assert a.overlaps(b) == (common is not None), (a, b)
        if a.numel:
            assert a.inside(b) == (common == a), (a, b)


def test_later_updates_replay_the_first_updates_copies_and_stay_exact():
    """A worker keeps what its first M->N update worked out (`PiecePrograms`): the next
    updates with the same plan land bit-exact without finding a single region again; a bucket
    replayed twice in one update is refused; a target whose storages moved (a swap, a
    reassigned parameter) is worked out anew and written where it now lives."""
    from wtransfer.receiver.programs import PiecePrograms
    from wtransfer.transport.m2n import Piece

    module = torch.nn.Linear(4, 4, bias=False)
    target = ModuleTarget(module)
    metas = [TensorMeta.of("weight", module.weight)]
    kept = {"weight": TensorLayout(name="weight", dtype="float32", shape=(4, 4),
                                   boxes=(Box(offsets=(1, 0), lengths=(2, 4)),))}
    pieces = [Piece(0, Box(offsets=(0, 0), lengths=(2, 4)), 0, 32),
              Piece(0, Box(offsets=(2, 0), lengths=(2, 4)), 0, 32)]  # rows 0-1, rows 2-3
    stagings = [torch.zeros(64, dtype=torch.uint8) for _ in pieces]
    found = []
    region = target.region
    target.region = lambda name, box: found.append(box) or region(name, box)
    programs = PiecePrograms()

    def update(step, *, twice=False):
        values = torch.randn(4, 4, generator=torch.Generator().manual_seed(step))
        for staging, piece in zip(stagings, pieces, strict=True):
            rows = piece.box.slices()[0]
            staging[:32].view(torch.float32).copy_(values[rows].flatten())
        session = UpdateSession(target, "cpu", programs=programs)
        session.announce(metas)
        session.keep_only(kept)
        found.clear()
        for staging, piece in zip(stagings, pieces, strict=True):
            session.consume_pieces(staging, 32, [piece], crop=True)
            if twice:
                with pytest.raises(MetadataError, match="arrived twice"):
                    session.consume_pieces(staging, 32, [piece], crop=True)
                return None
        session.finish()
        assert torch.equal(module.weight.detach()[1:3], values[1:3])
        assert session.bytes_received == 32
        return len(found)

    assert update(1) == 2  # worked out: one region per kept part
    assert update(2) == 0  # replayed
    assert update(3) == 0
    update(4, twice=True)
    module.weight.data = torch.zeros(4, 4)  # the parameter moved: its old views are stale
    assert update(5) == 2
    assert update(6) == 0
