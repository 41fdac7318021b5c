"""`StagedWeights` on its own: a swap commit exchanges every tensor (the weights' addresses
alternate between two sets), what an update did not write stays what was live, and the shadow
is put in the module's place only while nothing else reads or moves the live weights."""

import threading
import time

import pytest
import torch
from torch import nn

from wtransfer.errors import LifecycleError, TransferTimeout
from wtransfer.inference.updates.staging import StagedWeights


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))


def update(staging, version, **values):
    """Stage `values` ({"0": 1.0}: layer 0's weight filled with 1.0) and commit them, as an
    engine does: the tensors left unwritten levelled once the update wrote, then the commit."""
    staging.prepare()
    for layer, value in values.items():
        staging.dest(f"{layer}.weight").fill_(value)
    staging.level_unwritten()
    return staging.commit(version)


def weights(module):
    return {name: t.detach().clone() for name, t in module.state_dict().items()}


def test_updates_of_some_tensors_keep_the_others_and_addresses_alternate_between_two_sets():
    module = model()
    staging = StagedWeights(module, "swap")
    first = [p.data_ptr() for p in module.parameters()]
    start = weights(module)
    assert update(staging, "v0", **{"0": 1.0}) == 1
    second = [p.data_ptr() for p in module.parameters()]
    assert not set(first) & set(second)  # (every tensor moved, the unwritten ones too)
    assert update(staging, "v1", **{"1": 2.0}) == 1
    assert [p.data_ptr() for p in module.parameters()] == first
    now = weights(module)
    assert (now["0.weight"] == 1.0).all() and (now["1.weight"] == 2.0).all()
    assert torch.equal(now["0.bias"], start["0.bias"])
    assert staging.rollback() == 1  # (v0 back: layer 1 as it was, layer 0 as v0 left it)
    back = weights(module)
    assert (back["0.weight"] == 1.0).all() and torch.equal(back["1.weight"], start["1.weight"])
    assert [p.data_ptr() for p in module.parameters()] == second


def test_a_tensor_an_update_writes_whole_is_not_levelled_and_the_others_commit_as_live():
    """A start copies nothing into the shadow: a tensor the update writes whole still holds
    the version before the last one until it is written (no copy of the live weights that
    the update overwrites); the tensors it leaves unwritten are levelled before the swap, so
    they commit as they were live. The same holds where the engine never called
    `level_unwritten` (the commit levels them itself)."""
    module = model()
    staging = StagedWeights(module, "swap")
    start = weights(module)
    update(staging, "v0", **{"0": 1.0, "1": 2.0})
    staging.prepare()
    assert torch.equal(staging.dest("0.weight"), start["0.weight"])  # (v0's isn't copied in)
    staging.dest("0.weight").fill_(3.0)
    staging.level_unwritten()
    assert (staging.shadow["1.weight"] == 2.0).all()  # (levelled: v0's value)
    staging.commit("v0")
    now = weights(module)
    assert (now["0.weight"] == 3.0).all() and (now["1.weight"] == 2.0).all()
    staging.prepare()  # (v1 written; the commit levels layer 0 itself)
    staging.dest("1.weight").fill_(4.0)
    staging.commit("v1")
    now = weights(module)
    assert (now["0.weight"] == 3.0).all() and (now["1.weight"] == 4.0).all()
    assert torch.equal(now["0.bias"], start["0.bias"])
    assert staging.rollback() == 1
    back = weights(module)
    assert (back["0.weight"] == 3.0).all() and (back["1.weight"] == 2.0).all()


@pytest.mark.parametrize("mode", ["swap", "copy"])
def test_a_patch_writes_onto_the_live_weights_after_a_failed_update_and_a_swap(mode):
    """A delta writes only some elements: `level` brings the shadow to the live weights first,
    whatever a swap left in it or a failed update wrote into it."""
    module = model()
    staging = StagedWeights(module, mode)
    update(staging, "v0", **{"0": 1.0})
    staging.prepare()  # an update that fails half-way: never committed
    staging.dest("0.weight")[0].fill_(float("nan"))
    staging.prepare()
    staging.level()
    staging.dest("0.weight")[1, 2] = 7.0
    staging.level_unwritten()
    staging.commit("v1")
    expected = torch.full((4, 4), 1.0)
    expected[1, 2] = 7.0
    assert torch.equal(module[0].weight.detach(), expected)


def test_a_failed_update_s_writes_never_go_live_with_a_later_update_of_other_tensors():
    module = model()
    staging = StagedWeights(module, "swap")
    start = weights(module)
    staging.prepare()
    staging.dest("0.weight").fill_(float("nan"))  # (the update fails: no commit)
    update(staging, "v0", **{"1": 2.0})
    now = weights(module)
    assert torch.equal(now["0.weight"], start["0.weight"]) and (now["1.weight"] == 2.0).all()


def test_levelling_while_the_shadow_is_in_place_waits_and_reads_the_live_weights():
    """A decode-graph capture puts the shadow in the module's place on the engine thread; an
    update levelling on the transfer lane meanwhile waits for it, so it levels the shadow
    from the live weights, not from the shadow itself."""
    module = model()
    staging = StagedWeights(module, "swap")
    update(staging, "v0", **{"0": 1.0})
    staging.prepare()
    staging.dest("1.weight").fill_(2.0)
    levelled = threading.Event()
    with staging.shadow_in_place() as placed:
        assert placed
        lane = threading.Thread(target=lambda: (staging.level_unwritten(), levelled.set()))
        lane.start()
        assert not levelled.wait(0.3)  # (it waits for the shadow to leave)
    lane.join(10)
    assert levelled.is_set()
    staging.commit("v1")
    now = weights(module)
    assert (now["0.weight"] == 1.0).all() and (now["1.weight"] == 2.0).all()


def test_a_patch_never_levels_what_the_update_already_wrote():
    """An update that writes a tensor whole, then patches another (an adapter's slot after
    base tensors): levelling for the patch keeps what was written."""
    module = model()
    staging = StagedWeights(module, "copy")
    update(staging, "v0", **{"0": 1.0, "1": 2.0})
    staging.prepare()
    for layer in ("0", "1"):  # (a failed update: both stale)
        staging.dest(f"{layer}.weight")[0].fill_(float("nan"))
    staging.prepare()
    staging.dest("1.weight").fill_(5.0)
    staging.level()
    staging.dest("0.weight")[0, 0] = 6.0
    staging.commit("v1")
    now = weights(module)
    assert (now["1.weight"] == 5.0).all()
    assert now["0.weight"][0, 0] == 6.0 and (now["0.weight"].flatten()[1:] == 1.0).all()


def test_the_shadow_is_not_put_in_place_nor_a_rollback_made_while_the_weights_are_read():
    module = model()
    staging = StagedWeights(module, "swap")
    update(staging, "v0", **{"0": 1.0})
    live = [p.data_ptr() for p in module.parameters()]
    with staging.lock:  # (an update levelling the shadow, or a push reading the weights)
        with staging.shadow_in_place() as placed:
            assert not placed
            assert [p.data_ptr() for p in module.parameters()] == live
        with pytest.raises(LifecycleError, match="being read"):
            staging.rollback()
    with staging.shadow_in_place() as placed:
        assert placed and [p.data_ptr() for p in module.parameters()] != live
    assert [p.data_ptr() for p in module.parameters()] == live
    assert staging.rollback() == 1  # (once nothing reads them)


def test_an_update_start_during_a_reserved_rollback_is_refused_not_blocked():
    """A rollback reserved across commands (data-parallel ranks agree first) holds the lock
    until a later command: an update starting meanwhile is refused with a LifecycleError
    instead of waiting (which could block that later command); after the rollback it lands."""
    model = torch.nn.Linear(4, 4)
    staging = StagedWeights(model, "swap")
    staging.prepare()
    staging.dest("weight").add_(1)
    staging.commit("v0")
    staging.reserve_rollback()
    failed: list[BaseException] = []

    def start():
        try:
            staging.prepare()
        except BaseException as exc:
            failed.append(exc)

    thread = threading.Thread(target=start)
    thread.start()
    thread.join(10)
    assert not thread.is_alive()
    assert len(failed) == 1 and isinstance(failed[0], LifecycleError)
    assert "rollback of the weights is reserved" in str(failed[0])
    assert staging.rollback(reserved=True) == 1
    staging.prepare()  # free again


def test_an_update_start_during_a_one_shot_rollback_waits_for_it(monkeypatch):
    """A rollback done within one command (no ranks to agree with) holds the lock only while
    it swaps: an update starting meanwhile waits and then lands, it is not refused."""
    model = torch.nn.Linear(4, 4)
    staging = StagedWeights(model, "swap")
    staging.prepare()
    staging.dest("weight").add_(1)
    staging.commit("v0")
    swap = staging._swap_all
    swapping = threading.Event()

    def slow_swap():
        swapping.set()
        time.sleep(0.3)  # (longer than the start's polls of the lock)
        swap()

    monkeypatch.setattr(staging, "_swap_all", slow_swap)
    roll = threading.Thread(target=staging.rollback)
    roll.start()
    assert swapping.wait(10)
    staging.prepare()  # waits for the swap, then levels the shadow: no LifecycleError
    roll.join(10)
    assert not roll.is_alive() and staging.previous is None


def test_a_start_waits_for_busy_live_weights_only_until_its_deadline():
    """A commit or a push that never lets the live weights go (a hung device, say) makes an
    update start fail with TransferTimeout instead of waiting for ever."""
    staging = StagedWeights(torch.nn.Linear(4, 4), "swap")
    with staging.lock:  # (held by "a commit" for the whole wait)
        begin = time.monotonic()
        with (pytest.raises(TransferTimeout, match=r"the live weights stayed busy for 0\.2s"),
              staging.reading(wait_s=0.2)):
            pass
        assert time.monotonic() - begin < 5
    with staging.reading(wait_s=0.2):  # free again: taken at once
        pass


@pytest.mark.parametrize("mode", ["swap", "copy"])
def test_m2n_updates_into_the_shadow_replay_their_copies_and_commit_every_tensor(mode):
    """A staged worker's M->N updates (`ShardTarget` over the shadow): the copies worked out
    for each set of shadow storages are replayed by later updates into the same set (a swap
    alternates two), and a replayed update still commits every tensor it wrote, bit-exact."""
    from wtransfer.inference.updates.shard_target import ShardTarget
    from wtransfer.packing import TensorMeta
    from wtransfer.receiver.programs import PiecePrograms
    from wtransfer.receiver.session import UpdateSession
    from wtransfer.records import Box, TensorLayout
    from wtransfer.transport.m2n import Piece

    module = nn.Linear(4, 4, bias=False)
    staging = StagedWeights(module, mode)
    layouts = {"weight": TensorLayout.whole("weight", "float32", (4, 4))}
    target = ShardTarget(module, layouts, staging)
    metas = [TensorMeta("weight", "float32", (4, 4))]
    pieces = [Piece(0, Box(offsets=(0, 0), lengths=(2, 4)), 0, 32),
              Piece(0, Box(offsets=(2, 0), lengths=(2, 4)), 0, 32)]
    stagings = [torch.zeros(64, dtype=torch.uint8) for _ in pieces]
    found = []
    region = target.region
    target.region = lambda name, box: found.append(box) or region(name, box)
    programs = PiecePrograms()

    def update(step):
        values = torch.randn(4, 4, generator=torch.Generator().manual_seed(step))
        for buffer, piece in zip(stagings, pieces, strict=True):
            buffer[:32].view(torch.float32).copy_(values[piece.box.slices()[0]].flatten())
        staging.prepare()
        session = UpdateSession(target, "cpu", programs=programs)
        session.announce(metas)
        session.keep_only(target.keeps())
        found.clear()
        for buffer, piece in zip(stagings, pieces, strict=True):
            session.consume_pieces(buffer, 32, [piece], crop=True)
        session.finish()
        assert staging.commit(f"v{step - 1}") == 1  # (a replay counts what it wrote too)
        assert torch.equal(module.weight.detach(), values)
        return len(found)

    worked_out = [update(step) for step in range(1, 7)]
    assert worked_out == ([2, 2, 0, 0, 0, 0] if mode == "swap" else [2, 0, 0, 0, 0, 0])
