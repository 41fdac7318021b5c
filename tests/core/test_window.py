"""The posting units of the streaming backends: both sides must derive the same ones."""

from __future__ import annotations

import pytest
import torch

from wtransfer.errors import ConfigError
from wtransfer.packing import BucketPlan, TensorMeta
from wtransfer.window import units


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
