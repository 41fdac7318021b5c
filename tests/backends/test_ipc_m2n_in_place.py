"""ipc M->N read in place: the plan's pieces located in each rank's own shards, and a worker's
copies out of them (`wtransfer_ipc.m2n_in_place`), run on host tensors: the shards lie in one
flat storage per rank at offsets other than 0, as FSDP2 lays them out, and the worker keeps a
tensor-parallel part. (Mapping the storages across processes and the events need CUDA: the
GPU test in test_m2n_transfers.py.)"""

import pytest
import torch
from wtransfer_ipc.m2n_in_place import (
    _same,
    in_place_planner,
    offset_in_local,
    pieces_by_rank,
    rank_arrivals,
)
from wtransfer_ipc.zero_copy import ZeroCopyImports

from wtransfer.errors import MetadataError, NonFiniteError
from wtransfer.manifest import Manifest
from wtransfer.packing import TensorMeta
from wtransfer.receiver.programs import PiecePrograms
from wtransfer.receiver.session import UpdateSession
from wtransfer.receiver.target import ModuleTarget, WeightTarget
from wtransfer.records import Box, TensorLayout
from wtransfer.transport.m2n import Planner

FULL = {"proj": torch.randn(6, 4, dtype=torch.float32).to(torch.bfloat16),
        "norm": torch.randn(5)}
METAS = [TensorMeta.of(name, t) for name, t in FULL.items()]


def rows(name, start, stop):
    full = FULL[name]
    offsets, lengths = [0] * full.dim(), list(full.shape)
    offsets[0], lengths[0] = start, stop - start
    return TensorLayout(name=name, dtype=METAS[list(FULL).index(name)].dtype,
                        shape=tuple(full.shape),
                        boxes=(Box(offsets=tuple(offsets), lengths=tuple(lengths)),))


def flat_shards(layouts, pad=16):
    """One rank's local shards copied into one uint8 storage, `pad` bytes apart (and before
    the first): the storage and each tensor's [storage index, byte offset], flat."""
    parts = [FULL[m.name][layouts[m.name].boxes[0].slices()] for m in METAS]
    size = sum(pad + p.numel() * p.element_size() for p in parts) + pad
    storage = torch.zeros(size, dtype=torch.uint8)
    layout, at = [], pad
    for part in parts:
        nbytes = part.numel() * part.element_size()
        storage[at:at + nbytes].copy_(part.contiguous().view(-1).view(torch.uint8))
        layout += [0, at]
        at += nbytes + pad
    return storage, layout


def test_a_worker_copies_its_tensor_parallel_part_out_of_two_ranks_row_shards():
    """FSDP2-like rows on two ranks (uneven), a worker keeping columns 2-3 of `proj` and all
    of `norm`: the unbounded plan sends each rank's shard whole (no box cut, though the staged
    plan's buckets are 16 bytes), and the worker's copies out of both storages give exactly
    its part of every full tensor, nothing else written."""
    sources = [{"proj": rows("proj", 0, 4), "norm": rows("norm", 0, 3)},
               {"proj": rows("proj", 4, 6), "norm": rows("norm", 3, 5)}]
    plan = in_place_planner(Planner(sources, None, 16)).plan(Manifest(METAS))
    pieces = pieces_by_rank(plan, sources, METAS)
    assert pieces is not None
    assert [[(p.tensor, p.box) for p in mine] for mine in pieces] == [
        [(0, sources[r]["proj"].boxes[0]), (1, sources[r]["norm"].boxes[0])] for r in (0, 1)]
    assert all(p.offset == 0 for mine in pieces for p in mine)

    module = torch.nn.Module()
    module.proj = torch.nn.Parameter(torch.zeros(6, 4, dtype=torch.bfloat16))
    module.norm = torch.nn.Parameter(torch.zeros(5))
    session = UpdateSession(ModuleTarget(module), "cpu")
    session.announce(METAS)
    kept_box = Box(offsets=(0, 2), lengths=(6, 2))
    session.keep_only({"proj": TensorLayout(name="proj", dtype="bfloat16", shape=(6, 4),
                                            boxes=(kept_box,)),
                       "norm": TensorLayout.whole("norm", "float32", (5,))})
    arrivals = []
    for rank, layouts in enumerate(sources):
        storage, layout = flat_shards(layouts)
        arrivals += rank_arrivals({0: storage}, layout, pieces[rank], METAS)
    session.load_boxes(arrivals)
    session.finish()
    assert session.bytes_received == (6 * 2 * 2) + 5 * 4  # what it keeps, no more
    assert torch.equal(module.proj[:, 2:], FULL["proj"][:, 2:])
    assert torch.equal(module.proj[:, :2], torch.zeros(6, 2, dtype=torch.bfloat16))
    assert torch.equal(module.norm, FULL["norm"])


def test_replicas_share_the_tensors_and_each_comes_from_one_rank():
    whole = [{m.name: TensorLayout.whole(m.name, m.dtype, m.shape, replica=r) for m in METAS}
             for r in (0, 1)]
    plan = in_place_planner(Planner(whole, None, 16)).plan(Manifest(METAS))
    pieces = pieces_by_rank(plan, whole, METAS)
    assert pieces is not None
    assert sorted(p.tensor for mine in pieces for p in mine) == [0, 1]
    assert all(len(mine) == 1 for mine in pieces)  # the load split over both


def test_a_box_not_contiguous_in_its_rank_stages_instead():
    """A rank holding two boxes of a tensor side by side (concatenated along columns): the
    planned box is a strided part of its local tensor, so the update goes through staging."""
    two = TensorLayout(name="proj", dtype="bfloat16", shape=(6, 4), concat_dim=1,
                       boxes=(Box(offsets=(0, 0), lengths=(6, 1)),
                              Box(offsets=(0, 2), lengths=(6, 1))))
    assert offset_in_local(two, Box(offsets=(0, 0), lengths=(6, 1))) is None
    row_one = Box(offsets=(3, 0), lengths=(2, 4))  # from row 1 of the rank's 4x4 bf16 rows
    assert offset_in_local(rows("proj", 2, 6), row_one) == 8


def test_pieces_naming_what_the_rank_does_not_list_are_refused():
    sources = [{m.name: TensorLayout.whole(m.name, m.dtype, m.shape) for m in METAS}]
    plan = in_place_planner(Planner(sources, None, 16)).plan(Manifest(METAS))
    pieces = pieces_by_rank(plan, sources, METAS)
    assert pieces is not None
    storage, layout = flat_shards(sources[0])
    module = torch.nn.Module()
    module.proj = torch.nn.Parameter(torch.zeros(6, 4, dtype=torch.bfloat16))
    module.norm = torch.nn.Parameter(torch.zeros(5))
    session = UpdateSession(ModuleTarget(module), "cpu")
    session.announce(METAS)
    with pytest.raises(MetadataError, match="a storage and an offset for each of the 2"):
        rank_arrivals({0: storage}, layout[:2], pieces[0], METAS)
    with pytest.raises(MetadataError, match="lies in storage 0, which its rank does not list"):
        rank_arrivals({1: storage}, layout, pieces[0], METAS)
    with pytest.raises(MetadataError, match="does not fit its rank's 40-byte storage 0"):
        rank_arrivals({0: storage[:40]}, layout, pieces[0], METAS)
    arrivals = rank_arrivals({0: storage}, layout, pieces[0], METAS)
    with pytest.raises(MetadataError, match="boxes of tensor 'norm' do not cover it"):
        session.load_boxes(arrivals[:1])
    with pytest.raises(MetadataError, match=r"'proj': elements of box .* arrived twice"):
        session.load_boxes(arrivals + arrivals[:1])
    assert not session.touched  # nothing was written by a refused call


def two_ranks():
    """Each tensor's rows split over two ranks, each rank's shards in one flat storage:
    (the rank layouts, the plan's pieces, every rank's boxes and bytes)."""
    sources = [{"proj": rows("proj", 0, 4), "norm": rows("norm", 0, 3)},
               {"proj": rows("proj", 4, 6), "norm": rows("norm", 3, 5)}]
    pieces = pieces_by_rank(in_place_planner(Planner(sources, None, 16)).plan(Manifest(METAS)),
                            sources, METAS)
    assert pieces is not None
    storages, arrivals = [], []
    for rank, layouts in enumerate(sources):
        storage, layout = flat_shards(layouts)
        storages.append(storage)
        arrivals += rank_arrivals({0: storage}, layout, pieces[rank], METAS)
    return sources, storages, arrivals


def test_an_update_read_in_place_replays_its_copies_while_its_boxes_stay():
    """The same boxes again (the same list: the trainer ranks rewrote their shards in place)
    replay the first update's copies without looking up a region, and land the new values;
    a parameter that moved is looked up again."""
    sources, storages, arrivals = two_ranks()
    module = torch.nn.Module()
    module.proj = torch.nn.Parameter(torch.zeros(6, 4, dtype=torch.bfloat16))
    module.norm = torch.nn.Parameter(torch.zeros(5))
    target = ModuleTarget(module)
    found = []
    region = target.region
    target.region = lambda name, box: found.append(box) or region(name, box)
    programs = PiecePrograms()
    kept = {"proj": TensorLayout(name="proj", dtype="bfloat16", shape=(6, 4),
                                 boxes=(Box(offsets=(0, 1), lengths=(6, 2)),)),
            "norm": TensorLayout.whole("norm", "float32", (5,))}

    def update(step):
        for full in FULL.values():
            full.copy_(torch.randn(full.shape, generator=torch.Generator().manual_seed(step)))
        for storage, layouts in zip(storages, sources, strict=True):
            storage.copy_(flat_shards(layouts)[0])
        session = UpdateSession(target, "cpu", programs=programs)
        session.announce(METAS)
        session.keep_only(kept)
        found.clear()
        session.load_boxes(arrivals)
        session.finish()
        assert torch.equal(module.proj[:, 1:3], FULL["proj"][:, 1:3])
        assert torch.equal(module.norm, FULL["norm"])
        assert session.bytes_received == 6 * 2 * 2 + 5 * 4
        return len(found)

    assert update(1) > 0
    assert update(2) == 0  # replayed
    module.norm.data = torch.zeros(5)  # the parameter moved
    assert update(3) > 0
    assert update(4) == 0


class LoadsOnly(WeightTarget):
    """A target that offers no views of its tensors (as vLLM's): tensors go to its loader."""

    def __init__(self):
        self.loaded = {}

    def metadata(self):
        return METAS

    def load_weights(self, weights):
        self.loaded.update((name, t.clone()) for name, t in weights)

    def fingerprint(self):
        return {}


def test_a_target_without_views_gets_each_tensor_assembled_from_its_boxes():
    """A target with no views (as vLLM's) gets each tensor assembled from both ranks' boxes;
    a worker keeping a column part of `proj` copies only that part (its bytes are what it
    keeps) and still gets a full-shaped tensor for its loader."""
    _, _, arrivals = two_ranks()
    target = LoadsOnly()
    session = UpdateSession(target, "cpu", programs=PiecePrograms())
    session.announce(METAS)
    session.load_boxes(arrivals)
    session.finish()
    assert set(target.loaded) == set(FULL)
    assert all(torch.equal(target.loaded[n], t) for n, t in FULL.items())
    assert session.bytes_received == sum(m.nbytes for m in METAS)

    target = LoadsOnly()
    session = UpdateSession(target, "cpu", programs=PiecePrograms())
    session.announce(METAS)
    session.keep_only({"proj": TensorLayout(name="proj", dtype="bfloat16", shape=(6, 4),
                                            boxes=(Box(offsets=(0, 1), lengths=(6, 2)),)),
                       "norm": TensorLayout.whole("norm", "float32", (5,))})
    session.load_boxes(arrivals)
    session.finish()
    assert target.loaded["proj"].shape == (6, 4)
    assert torch.equal(target.loaded["proj"][:, 1:3], FULL["proj"][:, 1:3])
    assert torch.equal(target.loaded["norm"], FULL["norm"])
    assert session.bytes_received == 6 * 2 * 2 + 5 * 4


def test_an_update_read_in_place_holding_nan_is_refused_and_rolled_back():
    """A NaN in a box this worker keeps: finish refuses the update naming the tensor, and
    the rollback puts the old values back."""
    sources, storages, arrivals = two_ranks()
    module = torch.nn.Module()
    module.proj = torch.nn.Parameter(torch.ones(6, 4, dtype=torch.bfloat16))
    module.norm = torch.nn.Parameter(torch.ones(5))
    target = ModuleTarget(module)
    FULL["norm"][4] = float("nan")  # (rank 1's rows of norm)
    storages[1].copy_(flat_shards(sources[1])[0])
    try:
        session = UpdateSession(target, "cpu", rollback={})
        session.announce(METAS)
        session.load_boxes(arrivals)
        with pytest.raises(NonFiniteError, match="'norm' holds NaN"):
            session.finish()
        session.rollback()
    finally:
        FULL["norm"][4] = 0.0
    assert torch.equal(module.norm, torch.ones(5))
    assert torch.equal(module.proj, torch.ones(6, 4, dtype=torch.bfloat16))


def test_tensors_a_worker_keeps_nothing_of_or_that_are_empty_complete_at_once():
    """An empty tensor (no piece carries it) and a tensor this worker keeps none of: the
    update read in place completes without them, and only what it keeps is copied; a second
    load of the same update is refused."""
    full = {"a": torch.randn(4, 2), "empty": torch.zeros(0, 3), "b": torch.randn(3)}
    metas = [TensorMeta.of(n, t) for n, t in full.items()]
    layouts = {m.name: TensorLayout.whole(m.name, m.dtype, m.shape) for m in metas}
    pieces = pieces_by_rank(in_place_planner(Planner([layouts], None, 16)).plan(
        Manifest(metas)), [layouts], metas)
    assert pieces is not None and sorted(p.tensor for p in pieces[0]) == [0, 2]
    storage = torch.cat([full["a"].view(-1), full["b"]]).view(torch.uint8)
    arrivals = rank_arrivals({0: storage}, [0, 0, -1, 0, 0, 32], pieces[0], metas)
    module = torch.nn.Module()
    for name, t in full.items():
        module.register_parameter(name, torch.nn.Parameter(torch.zeros_like(t)))
    session = UpdateSession(ModuleTarget(module), "cpu")
    session.announce(metas)
    session.keep_only({"a": layouts["a"], "empty": layouts["empty"]})  # none of "b"
    session.load_boxes(arrivals)
    with pytest.raises(MetadataError, match="part of this update arrived already"):
        session.load_boxes(arrivals)
    session.finish()
    assert torch.equal(module.a, full["a"]) and not module.b.any()
    assert session.bytes_received == 4 * 2 * 4


def test_a_worker_reuses_its_boxes_only_while_every_rank_sends_the_same_storages_and_pieces():
    """What lets a worker replay its copies (`RanksInPlace`): the opened storages of a rank
    stay the very same mapping while nothing new is sent and the same storages are used
    (`ZeroCopyImports._open`), and the last update's boxes are reused only for the same
    tensor list, the same mappings and equal layouts and pieces (`_same`)."""
    imports = ZeroCopyImports()
    imports._opened = {0: torch.zeros(8, dtype=torch.uint8), 1: torch.zeros(8, dtype=torch.uint8)}
    opened = imports._opened
    imports._open([], [0, 1], "token", same_process=True)
    assert imports._opened is opened  # nothing changed: the same mapping
    imports._open([], [0], "token", same_process=True)
    assert imports._opened is not opened and list(imports._opened) == [0]
    assert list(opened) == [0, 1]  # the old mapping was not changed under its readers

    metas, storages = object(), {0: torch.zeros(1)}
    last = [metas, (storages, b"layout", [[0, [0], [1], 0, 2]])]
    assert _same(last, [metas, (storages, b"layout", [[0, [0], [1], 0, 2]])])
    assert not _same(last, [object(), (storages, b"layout", [[0, [0], [1], 0, 2]])])
    assert not _same(last, [metas, (dict(storages), b"layout", [[0, [0], [1], 0, 2]])])
    assert not _same(last, [metas, (storages, b"other", [[0, [0], [1], 0, 2]])])
    assert not _same(last, [metas, (storages, b"layout", [[0, [0], [1], 2, 2]])])
    assert not _same(last, [metas, *last[1:], (storages, b"layout", [])])
