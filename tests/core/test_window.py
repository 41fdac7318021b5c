"""The posting units of the streaming backends: both sides must derive the same ones."""

from __future__ import annotations

import pytest
import torch

from wtransfer.errors import ConfigError
from wtransfer.packing import BucketPlan, TensorMeta
from wtransfer.transport.window import receive_buckets, units


def _plan(sizes: list[int], threshold: int) -> BucketPlan:
    metas = [TensorMeta(f"t{i}", "uint8", (n,)) for i, n in enumerate(sizes)]
    return BucketPlan.build(metas, 1024, 256, direct_threshold=threshold)


def _shape(groups: list[list]) -> list[list[str]]:
    return [["d" if b.direct else f"p{len(b.slices)}" for b in g] for g in groups]


def test_runs_of_direct_buckets_are_batched_and_packed_ones_stand_alone() -> None:
    # 2 large, 2 small (one packed bucket), 5 large, 1 small
    plan = _plan([4096, 4096, 10, 20, 4096, 4096, 4096, 4096, 4096, 30], threshold=2048)
    assert _shape(units(plan.buckets, 3)) == [
        ["d", "d"], ["p2"], ["d", "d", "d"], ["d", "d"], ["p1"]]
    assert _shape(units(plan.buckets, 1)) == [
        ["d"], ["d"], ["p2"], ["d"], ["d"], ["d"], ["d"], ["d"], ["p1"]]
    flat = [b.index for g in units(plan.buckets, 3) for b in g]
    assert flat == [b.index for b in plan.buckets]  # same order, nothing lost


def test_units_are_a_function_of_the_plan_alone() -> None:
    sizes = [int(n) for n in torch.randint(1, 5000, (200,), generator=torch.Generator()
                                           .manual_seed(3))]
    a = units(_plan(sizes, 1000).buckets, 32)
    b = units(_plan(list(sizes), 1000).buckets, 32)
    assert [[x.index for x in g] for g in a] == [[x.index for x in g] for g in b]
    assert max(len(g) for g in a) <= 32


def test_nccl_receiver_refuses_a_batch_out_of_range() -> None:
    from wtransfer_nccl.info import NCCLInitInfo

    base = dict(master_address="127.0.0.1", master_port=1234, world_size=2, rank_offset=1,
                transport="gloo")
    assert NCCLInitInfo(**base, batch=32).batch == 32
    with pytest.raises(ConfigError, match=r"batch must be in 1\.\.1024, got 0"):
        NCCLInitInfo(**base, batch=0)
    with pytest.raises(ConfigError, match=r"first_batch must be in 1\.\.batch \(32\), got 33"):
        NCCLInitInfo(**base, batch=32, first_batch=33)


def test_temporaries_in_flight_stay_within_the_budget_and_every_bucket_lands_in_order() -> None:
    plan = _plan([4096] * 40 + [10, 20] + [4096] * 30, threshold=2048)
    landed: list[int] = []
    inflight: list[int] = []
    peak = 0

    def post(unit, data):
        nonlocal peak
        inflight.extend(d.numel() for d, b in zip(data, unit, strict=True) if b.direct)
        peak = max(peak, sum(inflight))
        return [d.numel() for d, b in zip(data, unit, strict=True) if b.direct]

    def wait(sizes):
        for n in sizes:
            inflight.remove(n)

    receive_buckets(
        plan.buckets, 2, max_inflight=16, batch=8,
        destination=lambda b: torch.empty(b.nbytes, dtype=torch.uint8),
        staging=lambda b, slot: torch.empty(1024, dtype=torch.uint8)[: b.nbytes],
        post=post, wait=wait,
        landed=lambda b, slot, data: landed.append(b.index),
        temporary=lambda b: b.nbytes, budget=3 * 8 * 4096)
    assert landed == [b.index for b in plan.buckets]
    assert peak == 3 * 8 * 4096  # three units of eight in flight, never a fourth


def test_one_unit_goes_even_when_it_alone_is_over_the_budget() -> None:
    plan = _plan([4096] * 5, threshold=2048)
    landed: list[int] = []
    receive_buckets(
        plan.buckets, 1, max_inflight=16, batch=5,
        destination=lambda b: torch.empty(b.nbytes, dtype=torch.uint8),
        staging=lambda b, slot: torch.empty(0, dtype=torch.uint8),
        post=lambda unit, data: None, wait=lambda op: None,
        landed=lambda b, slot, data: landed.append(b.index),
        temporary=lambda b: b.nbytes, budget=100)
    assert landed == [0, 1, 2, 3, 4]


def test_the_first_unit_may_be_smaller_and_the_rest_keep_the_batch() -> None:
    plan = _plan([4096] * 9 + [10], threshold=2048)
    assert _shape(units(plan.buckets, 4, first=2)) == [
        ["d", "d"], ["d", "d", "d", "d"], ["d", "d", "d"], ["p1"]]
    packed_first = _plan([10] + [4096] * 5, threshold=2048)  # only the very first unit
    assert _shape(units(packed_first.buckets, 4, first=2)) == [
        ["p1"], ["d", "d", "d", "d"], ["d"]]
