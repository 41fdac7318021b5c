"""Packing: plans are deterministic and bounded; round trips are bit-exact for every dtype."""

import contextlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from wtransfer.errors import ConfigError, IntegrityError, MetadataError, NonFiniteError
from wtransfer.packing import (
    DTYPES,
    BucketPacker,
    BucketPlan,
    TensorMeta,
    bucket_checksum,
    byte_view,
    tensor_from_bytes,
)
from wtransfer.receiver.programs import PiecePrograms
from wtransfer.receiver.session import UpdateSession
from wtransfer.receiver.target import ModuleTarget
from wtransfer.shapes import build_module
from wtransfer.trainer.source import ModuleSource


def random_tensor(dtype_name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Arbitrary bit patterns of the dtype (NaNs and all), so bit-exactness is really tested."""
    dtype = DTYPES[dtype_name]
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8,
                        generator=torch.Generator().manual_seed(seed))
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


shapes = st.lists(st.integers(0, 9), min_size=0, max_size=4).map(tuple)
tensor_specs = st.lists(
    st.tuples(st.sampled_from(sorted(DTYPES)), shapes, st.booleans()), min_size=1, max_size=12
)


def transfer(tensors: dict[str, torch.Tensor], bucket_bytes: int, align: int = 256,
             checksum: bool = False, dest=None) -> dict[str, torch.Tensor]:
    """Pack on one side, unpack into a module of other values on the other, via staging."""
    metas = [TensorMeta.of(n, t) for n, t in tensors.items()]
    plan = BucketPlan.build(metas, bucket_bytes, align)
    dest = build_module(metas, seed=99) if dest is None else dest
    session = UpdateSession(ModuleTarget(dest), "cpu",
                            check_finite=False)  # (arbitrary bit patterns, NaNs included)
    session.announce(metas)
    packer = BucketPacker(plan, iter(tensors.items()))
    staging = torch.empty(bucket_bytes, dtype=torch.uint8)
    for bucket in plan.buckets:
        assert bucket.nbytes <= bucket_bytes
        packer.pack(bucket, staging)
        digest = bucket_checksum(staging[: bucket.nbytes]) if checksum else None
        session.consume(staging, bucket.nbytes, bucket.slices, digest)
    packer.finish()
    session.finish()
    return dest.state_dict()


@settings(max_examples=150, deadline=None)
@given(specs=tensor_specs, bucket_bytes=st.integers(256, 2048), seed=st.integers(0, 10**6),
       checksum=st.booleans())
def test_round_trip_is_bit_exact_for_every_dtype_and_shape(specs, bucket_bytes, seed, checksum):
    tensors = {}
    for i, (dtype, shape, transpose) in enumerate(specs):
        t = random_tensor(dtype, shape, seed + i)
        if transpose and t.dim() >= 2:
            t = t.transpose(0, 1)  # non-contiguous source
        tensors[f"layer{i}.w"] = t
    out = transfer(tensors, bucket_bytes, checksum=checksum)
    for name, t in tensors.items():
        got = out[name]
        assert got.dtype == t.dtype and got.shape == t.shape
        assert torch.equal(byte_view(got), byte_view(t)), name


@given(sizes=st.lists(st.integers(0, 5000), min_size=1, max_size=30),
       bucket_bytes=st.integers(256, 4096), align=st.sampled_from([1, 8, 64, 256]))
def test_plan_is_deterministic_aligned_bounded_and_complete(sizes, bucket_bytes, align):
    if bucket_bytes < align:
        return
    metas = [TensorMeta(f"t{i}", "uint8", (n,)) for i, n in enumerate(sizes)]
    plan = BucketPlan.build(metas, bucket_bytes, align)
    assert plan == BucketPlan.build(metas, bucket_bytes, align)
    covered = {i: 0 for i in range(len(metas))}
    for bucket in plan.buckets:
        assert len(bucket.slices) > 0 and bucket.nbytes <= bucket_bytes
        for s in bucket.slices:
            assert s.offset + s.nbytes <= bucket.nbytes or s.nbytes == 0
            if s.tensor_offset == 0 and s.nbytes:
                assert s.offset % align == 0
            assert s.tensor_offset == covered[s.tensor]
            covered[s.tensor] += s.nbytes
    assert covered == {i: n for i, n in enumerate(sizes)}


def test_tensor_larger_than_a_bucket_is_split_and_staging_stays_bounded():
    metas = [TensorMeta("small", "float32", (10,)), TensorMeta("big", "bfloat16", (5000,))]
    plan = BucketPlan.build(metas, bucket_bytes=1024)
    big_slices = [s for b in plan.buckets for s in b.slices if s.tensor == 1]
    # fills the first bucket after "small" (768 B), nine whole buckets, then the last 16 B
    assert [s.nbytes for s in big_slices] == [768] + [1024] * 9 + [16]
    assert all(b.nbytes <= 1024 for b in plan.buckets)


def test_split_tensor_lands_in_place_without_a_temporary():
    big = random_tensor("float32", (3000,), 1)
    metas = [TensorMeta.of("w", big)]
    dest = build_module(metas, seed=3)
    ptr = dest.w.data_ptr()
    out = transfer({"w": big}, bucket_bytes=1024, dest=dest)
    assert torch.equal(byte_view(out["w"]), byte_view(big))
    assert dest.w.data_ptr() == ptr


def test_bad_plan_parameters_are_config_errors():
    with pytest.raises(ConfigError, match="power of two"):
        BucketPlan.build([], 1024, align=3)
    with pytest.raises(ConfigError, match="bucket_bytes"):
        BucketPlan.build([], 100, align=256)


def test_source_that_differs_from_its_announcement_is_caught_on_the_sender():
    metas = [TensorMeta("a", "float32", (4,)), TensorMeta("b", "float32", (4,))]
    plan = BucketPlan.build(metas, 1024)
    packer = BucketPacker(plan, iter([("a", torch.zeros(4)), ("b", torch.zeros(5))]))
    with pytest.raises(MetadataError, match="announced"):
        packer.pack(plan.buckets[0], torch.empty(1024, dtype=torch.uint8))


def test_a_released_packer_reads_no_further_and_an_unreleased_one_checks_to_the_end():
    metas = [TensorMeta("a", "float32", (4,)), TensorMeta("b", "float32", (4,))]
    plan = BucketPlan.build(metas, 1024)

    def wrong_source():
        yield "a", torch.zeros(4)
        yield "b", torch.zeros(5)  # not what was announced

    with pytest.raises(MetadataError, match="announced"):
        BucketPacker(plan, wrong_source()).finish()
    released = BucketPacker(plan, wrong_source())
    released.release()  # the sender read the tensors in place (`WeightSource.held`)
    released.finish()


def test_corrupted_bucket_raises_integrity_error_and_checksum_sees_reordering():
    data = torch.arange(4096, dtype=torch.int32).view(torch.uint8)
    digest = bucket_checksum(data)
    swapped = data.clone().view(torch.int64)
    swapped[[3, 7]] = swapped[[7, 3]]
    assert bucket_checksum(swapped.view(torch.uint8)) != digest
    flipped = data.clone()
    flipped[1000] ^= 1
    assert bucket_checksum(flipped) != digest
    metas = [TensorMeta("w", "int32", (4096,))]
    session = UpdateSession(ModuleTarget(build_module(metas, 0)), "cpu")
    session.announce(metas)
    plan = BucketPlan.build(metas, 1 << 16)
    with pytest.raises(IntegrityError, match="checksum"):
        session.consume(flipped.view(torch.uint8), plan.buckets[0].nbytes,
                        plan.buckets[0].slices, digest)


def test_incomplete_update_is_an_integrity_error():
    metas = [TensorMeta("a", "float32", (4,)), TensorMeta("b", "float32", (4,))]
    session = UpdateSession(ModuleTarget(build_module(metas, 0)), "cpu")
    session.announce(metas)
    with pytest.raises(IntegrityError, match="never arrived"):
        session.finish()


def test_hostile_slices_are_refused_before_touching_weights():
    metas = [TensorMeta("a", "float32", (16,))]
    module = build_module(metas, 0)
    before = module.a.clone()
    session = UpdateSession(ModuleTarget(module), "cpu")
    session.announce(metas)
    staging = torch.zeros(1024, dtype=torch.uint8)
    from wtransfer.packing import Slice

    for bad, match in [
        (Slice(1, 0, 0, 64), "only 1 were announced"),
        (Slice(0, 0, 1000, 64), "outside"),
        (Slice(0, 32, 0, 64), "past its"),
        (Slice(0, 0, 3, 64), "aligned"),
    ]:
        with pytest.raises(MetadataError, match=match):
            session.consume(staging, 1024, [bad])
    with pytest.raises(MetadataError, match="does not fit"):
        session.consume(staging, 4096, [])
    assert torch.equal(module.a, before) and not session.touched


def test_module_source_sends_tied_weights_once():
    emb = torch.nn.Embedding(10, 4)
    model = torch.nn.Module()
    model.embed = emb
    model.head = torch.nn.Linear(4, 10, bias=False)
    model.head.weight = emb.weight
    names = [m.name for m in ModuleSource(model).metadata()]
    assert names == ["embed.weight"]


@settings(max_examples=300, deadline=None)
@given(slices=st.lists(st.lists(st.integers(-3, 1 << 40), min_size=3, max_size=5), max_size=6),
       nbytes=st.integers(-10, 1 << 13))
def test_arbitrary_slices_only_raise_metadata_errors(slices, nbytes):
    from wtransfer.packing import Slice

    metas = [TensorMeta("a", "float32", (16,)), TensorMeta("b", "bfloat16", (3, 700))]
    session = UpdateSession(ModuleTarget(build_module(metas, 0)), "cpu")
    session.announce(metas)
    staging = torch.zeros(4096, dtype=torch.uint8)
    with contextlib.suppress(MetadataError):
        session.consume(staging, nbytes, [Slice.from_wire(s) for s in slices])


def test_tensors_made_as_they_are_yielded_pack_bit_exact():
    """Host tensors are packed by address: each stays alive until its bytes are copied, even
    when the source makes it as it yields it and keeps no reference (as `Fp8Source` does);
    a non-contiguous one is copied through a contiguous view."""
    wants = [random_tensor("float32", (64, 33), seed) for seed in range(6)]
    wants[2] = wants[2].t()  # not contiguous
    metas = [TensorMeta.of(f"t{i}", w) for i, w in enumerate(wants)]
    plan = BucketPlan.build(metas, bucket_bytes=4096)

    junk = []

    def made_on_the_fly():
        for i, want in enumerate(wants):
            junk.extend(torch.full_like(w, -1.0) for w in wants)  # reuses what was freed
            yield f"t{i}", want.clone()  # the packer holds the only reference

    packer = BucketPacker(plan, made_on_the_fly())
    staging = torch.empty(4096, dtype=torch.uint8)
    got = torch.empty(sum(m.nbytes for m in metas), dtype=torch.uint8)
    starts = [0]
    for m in metas:
        starts.append(starts[-1] + m.nbytes)
    for bucket in plan.buckets:
        torch.randint(0, 255, (4096,), dtype=torch.uint8, out=staging)  # stale bytes
        packer.pack(bucket, staging)
        for s in bucket.slices:
            at = starts[s.tensor] + s.tensor_offset
            got[at: at + s.nbytes] = staging[s.offset: s.offset + s.nbytes]
    packer.finish()
    assert torch.equal(got, torch.cat([byte_view(w.contiguous()) for w in wants]))


@pytest.mark.parametrize("rank", [0, 1])
def test_a_whole_update_into_a_tp_worker_copies_and_checks_only_the_parts_it_keeps(
        rank, monkeypatch):
    """`load_whole` (a zero-copy update: every tensor whole in the sender's memory) into one
    worker of TP=2 copies only its layout's part of each split tensor, row-split (contiguous)
    or column-split (strided): its weights equal the full tensors' parts bit-exact, it counts
    only the bytes it keeps, and its finite check reads only those: a NaN in the other
    worker's half of a strided tensor is the other worker's to refuse, one in its own half
    is refused naming the tensor."""
    from wtransfer.inference.config import MODEL_CONFIGS
    from wtransfer.inference.model.decoder import load_model, shard_model
    from wtransfer.inference.model.parallel import Parallel, layouts
    from wtransfer.inference.updates.shard_target import ShardTarget

    full = load_model("tiny", seed=3)
    state = full.state_dict()
    parallel = Parallel(rank=rank, size=2)
    kept = layouts(MODEL_CONFIGS["tiny"], parallel, state)
    worker = shard_model(load_model("tiny", seed=4), parallel)
    metas = [TensorMeta.of(n, t) for n, t in state.items()]
    strided = next(n for n, lay in kept.items()
                   if not lay.is_whole and not lay.take(state[n]).is_contiguous())
    assert any(not lay.is_whole and lay.take(state[n]).is_contiguous()
               for n, lay in kept.items())  # (both kinds of split are exercised)

    target = ShardTarget(worker, kept)
    programs = PiecePrograms()
    plans = []
    plan_whole = UpdateSession._plan_whole
    monkeypatch.setattr(UpdateSession, "_plan_whole",
                        lambda self, *a: plans.append(1) or plan_whole(self, *a))
    sources = [byte_view(state[m.name]).clone() for m in metas]  # the trainer's memory
    by_name = {m.name: tensor_from_bytes(src, m) for m, src in zip(metas, sources, strict=True)}

    def update():  # the first works the copies out, later ones replay them
        session = UpdateSession(target, "cpu", programs=programs)
        session.announce(metas)
        session.load_whole(sources)
        session.finish()
        return session.bytes_received

    for step in range(2):
        for name, values in by_name.items():  # an optimizer step, in place
            values.copy_(state[name] * (1 + step))
        received = update()
        live = worker.state_dict()
        for name, layout in kept.items():
            assert torch.equal(live[name], layout.take(by_name[name])), (step, name)
        assert received == sum(lay.nbytes for lay in kept.values())
        assert received < 0.7 * sum(t.nbytes for t in state.values())
    assert len(plans) == 1  # the second update replayed the first one's copies
    mine = kept[strided].boxes[0]
    theirs = 0 if mine.offsets[-1] else -1  # a column this worker does not keep
    by_name[strided][0, theirs] = float("nan")
    update()  # not this worker's to refuse
    by_name[strided][0, mine.offsets[-1]] = float("nan")
    with pytest.raises(NonFiniteError, match=f"'{strided}' holds NaN"):
        update()


def test_a_whole_update_asks_what_a_target_keeps_only_where_it_offers_views_of_parts():
    """A target without views (vLLM's records what it keeps when asked) is not asked what it
    keeps by a whole update: every tensor goes whole to `load_weights`."""
    from wtransfer.receiver.target import WeightTarget

    loaded = []

    class NoViews(ModuleTarget):
        region = WeightTarget.region  # (the base's: no views)

        def direct_bytes(self, name):
            return None

        def load_weights(self, weights):
            weights = list(weights)
            loaded.extend((name, tuple(t.shape)) for name, t in weights)
            super().load_weights(weights)

        def keeps(self):
            raise AssertionError("a whole update asked what this target keeps")

    metas = [TensorMeta("w", "float32", (4, 3)), TensorMeta("b", "float32", (3,))]
    sent = build_module(metas, 3).state_dict()
    module = build_module(metas, 0)
    session = UpdateSession(NoViews(module), "cpu")
    session.announce(metas)
    session.load_whole([byte_view(sent[m.name]).clone() for m in metas])
    session.finish()
    assert all(torch.equal(module.state_dict()[n], sent[n]) for n in sent)
    assert sorted(loaded) == [("b", (3,)), ("w", (4, 3))]
