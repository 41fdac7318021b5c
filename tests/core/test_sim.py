"""The planner's invariants on random layouts (hypothesis), and the simulator on cases small
enough to compute by hand."""

import math
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from wtransfer.errors import ConfigError
from wtransfer.packing import TensorMeta
from wtransfer.sim.cluster import Cluster, Link
from wtransfer.sim.command import parse_engine
from wtransfer.sim.layouts import engine_layouts, fsdp_layouts, megatron_layouts, tp_layout
from wtransfer.sim.models import qwen3_moe_metas, scale_metas
from wtransfer.sim.simulate import simulate
from wtransfer.transport.m2n import plan_transfers

NAMES = ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
         "model.layers.0.self_attn.o_proj.weight", "model.layers.0.mlp.gate_proj.weight",
         "model.layers.0.input_layernorm.weight", "model.layers.0.mlp.down_proj.weight"]


@st.composite
def cases(draw):
    metas = []
    for name in NAMES:
        rows = draw(st.integers(1, 40))
        shape = (rows,) if name.endswith("layernorm.weight") else (rows, draw(st.integers(1, 12)))
        metas.append(TensorMeta(name, "float32", shape))
    return (metas, draw(st.integers(1, 5)), draw(st.integers(1, 2)), draw(st.integers(1, 4)),
            draw(st.sampled_from([64 << 0, 256, 1024, 1 << 16])))


def run(plan, metas, sources, dests, full):
    """Move real tensors through the plan; each worker's local tensors."""
    local_src = [{n: lay.take(full[n]).clone() for n, lay in held.items()} for held in sources]
    local_dst = [{n: torch.full(lay.local_shape, float("nan")) for n, lay in kept.items()}
                 for kept in dests]
    for b in plan.buckets:
        data = torch.zeros(max(b.nbytes, 1), dtype=torch.uint8)
        for p in b.pieces:
            name = metas[p.tensor].name
            data[p.offset:p.offset + p.nbytes].view(torch.float32).view(p.box.lengths).copy_(
                sources[b.sender][name].view(local_src[b.sender][name], p.box))
        for p in b.pieces:
            name = metas[p.tensor].name
            dests[b.worker][name].view(local_dst[b.worker][name], p.box).copy_(
                data[p.offset:p.offset + p.nbytes].view(torch.float32).view(p.box.lengths))
    return local_dst


@settings(max_examples=60, deadline=None)
@given(cases())
def test_every_kept_byte_arrives_exactly_once_and_pairs_sum_to_what_is_kept(case):
    metas, ranks, replicas, tp, bucket = case
    full = {m.name: torch.randn(m.shape) for m in metas}
    sources = fsdp_layouts(metas, ranks)
    dests = engine_layouts(metas, replicas, tp, ep=False)
    plan = plan_transfers(metas, sources, dests, bucket)
    got = run(plan, metas, sources, dests, full)
    for kept, local in zip(dests, got, strict=True):  # NaN anywhere: a byte never arrived
        for name, lay in kept.items():
            assert torch.equal(local[name], lay.take(full[name])), name
    kept_bytes = sum(lay.numel * 4 for kept in dests for lay in kept.values())
    assert sum(plan.bytes_to(w) for w in range(len(dests))) == kept_bytes
    assert sum(plan.bytes_from(s) for s in range(ranks)) == kept_bytes
    assert all(b.nbytes <= max(bucket, 4) for b in plan.buckets)


@settings(max_examples=40, deadline=None)
@given(cases())
def test_replicas_share_the_load_within_one_piece(case):
    metas, ranks, replicas, tp, bucket = case
    whole = [{m.name: tp_layout(m, 0, 1, replica=r) for m in metas} for r in range(ranks)]
    dests = engine_layouts(metas, replicas, tp, ep=False)
    plan = plan_transfers(metas, whole, dests, bucket)
    sent = [plan.bytes_from(s) for s in range(ranks)]
    largest_box = max(lay.numel * 4 for kept in dests for lay in kept.values())
    assert max(sent) - min(sent) <= largest_box  # greedy: each box to the least loaded


def test_the_large_lists_have_their_published_sizes():
    sizes = {name: sum(math.prod(m.shape) for m in scale_metas(name))
             for name in ("qwen3-235b-a22b", "deepseek-v3", "kimi-k2")}
    assert 234e9 < sizes["qwen3-235b-a22b"] < 236e9
    assert 670e9 < sizes["deepseek-v3"] < 672e9  # without the multi-token-prediction layer
    assert 1.02e12 < sizes["kimi-k2"] < 1.04e12
    kimi = scale_metas("kimi-k2")
    assert sum(".experts." in m.name for m in kimi) == 60 * 384 * 3


def test_megatron_places_each_expert_once_per_copy_and_splits_attention():
    metas = qwen3_moe_metas(layers=2, hidden=64, heads=4, kv_heads=1, head_dim=128,
                            experts=8, width=32, vocab=100)
    ranks = megatron_layouts(metas, world=8, tp=2, pp=2, ep=2)
    expert = "model.layers.1.mlp.experts.5.up_proj.weight"
    holders = [r for r, held in enumerate(ranks) if expert in held]
    assert holders == [5, 7]  # stage 1 (ranks 4..7); expert 5 of 8 over 2 -> index 1, 2 copies
    q = "model.layers.0.self_attn.q_proj.weight"
    assert [r for r, held in enumerate(ranks) if q in held] == [0, 1, 2, 3]  # stage 0
    assert ranks[0][q].boxes[0].lengths == (256, 64)  # 512 rows, tp=2
    assert ranks[1][q].boxes[0].offsets == (256, 0)
    k = "model.layers.0.self_attn.k_proj.weight"  # one key head, two ranks: both hold it
    assert ranks[0][k].boxes == ranks[1][k].boxes and ranks[0][k].replica != ranks[1][k].replica
    assert "lm_head.weight" in ranks[4] and "model.embed_tokens.weight" in ranks[0]
    with pytest.raises(ConfigError, match="must split into pp=3"):
        megatron_layouts(metas, world=8, tp=2, pp=3, ep=4)


def test_one_bucket_by_hand():
    """One 1 MB bucket from a trainer GPU to a worker on another node: pack (read + write at
    1 GB/s: 2 ms), send (10 us + 1 MB at 100 MB/s: 10.01 ms), apply (2 ms), control (2 ms)."""
    cluster = Cluster(gpus_per_node=1, nic=Link("nic", 1e8, 1e-5), nvlink=Link("nvlink", 1e9, 0),
                      local=Link("local", 1e9, 0), memory_bandwidth=1e9, senders=1)
    metas = [TensorMeta("w", "uint8", (1_000_000,))]
    layouts = [{"w": tp_layout(metas[0], 0, 1)}]
    plan = plan_transfers(metas, layouts, layouts, 1 << 20, align=1)
    p = simulate(plan, metas, cluster, control_s=0.002)
    assert p.seconds == pytest.approx(0.002 + 0.01001 + 0.002 + 0.002)
    assert (p.busiest, p.link_bytes, p.max_messages_per_pair) == ("trainer rank 0 out",
                                                                 {"nic": 1_000_000}, 1)
    # two buckets of 0.5 MB, one staging slot: the second packs only once the first left
    plan = plan_transfers(metas, layouts, layouts, 500_000, align=1)
    p = simulate(plan, metas, cluster, num_buffers=1, control_s=0)
    pack, send, apply = 0.001, 1e-5 + 0.005, 0.001
    first_sent = pack + send
    second_sent = first_sent + pack + send  # packed after the slot came back
    assert p.seconds == pytest.approx(second_sent + apply)
    # with two slots the second pack overlaps the first send
    p = simulate(plan, metas, cluster, num_buffers=2, control_s=0)
    assert p.seconds == pytest.approx(pack + 2 * send + apply)


def test_the_broadcast_baseline_by_hand():
    """Two senders, two workers, all on different nodes: rank 0 gathers half the model over
    its NIC, converts nothing, and broadcasts it once over its NIC (one bucket)."""
    cluster = Cluster(gpus_per_node=1, nic=Link("nic", 1e8, 0), nvlink=Link("nvlink", 1e9, 0),
                      local=Link("local", 1e9, 0), memory_bandwidth=1e9, senders=2)
    metas = [TensorMeta("w", "uint8", (1_000_000,))]
    sources = fsdp_layouts(metas, 2)
    dests = [{"w": tp_layout(metas[0], 0, 1, r)} for r in range(2)]
    plan = plan_transfers(metas, sources, dests, 1 << 20, align=1)
    p = simulate(plan, metas, cluster, control_s=0)
    gather, convert, cast, apply = 0.005, 0.002, 0.01, 0.002
    assert p.broadcast_seconds == pytest.approx(gather + convert + cast + apply)
    assert p.seconds < p.broadcast_seconds  # each rank sends its half to each worker


def test_engine_specs_are_parsed_or_named():
    assert parse_engine("8x16ep") == (8, 16, True)
    assert parse_engine("2x8") == (2, 8, False)
    with pytest.raises(ConfigError, match="expected REPLICASxTP"):
        parse_engine("eight")


def test_one_gpu_paths_add_up_by_hand():
    """`wtransfer plan --one-gpu`: every rank shares one memory; a bucket is handed over, not
    moved (the host path's "send" is its host-to-device copy). Two tensors of 1 MB, one
    bucket each, one slot: every stage waits for the one before it."""
    from wtransfer.sim.one_gpu import OneGpu, predict_one_gpu

    metas = [TensorMeta("a", "uint8", (1_000_000,)), TensorMeta("b", "uint8", (1_000_000,))]
    gpu = OneGpu(memory_bandwidth=1e9, h2d_bandwidth=1e8, check_bandwidth=5e8,
                 handover_s=1e-3, control_s=2e-3)
    n = 1_000_000
    copy, check = 2 * n / 1e9, n / 5e8
    zero = predict_one_gpu("zero-copy", metas, gpu)
    assert zero["predicted_s"] == pytest.approx(2 * copy + 2 * check + 2e-3)
    assert zero["one_copy_s"] == pytest.approx(2 * copy)
    packed = predict_one_gpu("packed", metas, gpu, bucket_bytes=n, num_buffers=1)
    # pack a; hand a over; apply a (the memory is busy), then pack b, hand over, apply b
    assert packed["predicted_s"] == pytest.approx(2 * (copy + 1e-3 + copy + check) + 2e-3)
    host = predict_one_gpu("host", metas, gpu, bucket_bytes=n, num_buffers=1)
    # b's host-to-device copy waits for a's slot, freed once a is applied
    assert host["predicted_s"] == pytest.approx(2 * (1e-3 + n / 1e8 + copy + check) + 2e-3)
    # M->N read in place: one copy in all, one update call, every piece checked after it
    in_place = predict_one_gpu("m2n-in-place", metas, gpu, senders=2)
    assert in_place["predicted_s"] == pytest.approx(2 * copy + 2 * check + 1e-3 + 2e-3)
    with pytest.raises(ConfigError, match="one-GPU path 'nvlink'"):
        predict_one_gpu("nvlink", metas, gpu)
    # tensors of 1 MiB and more that land whole are checked inside their copy: no second read
    big = [TensorMeta("a", "bfloat16", (1_500_000,)), TensorMeta("b", "bfloat16", (1_500_000,))]
    nb = 3_000_000
    big_copy, big_check = 2 * nb / 1e9, nb / 5e8
    assert predict_one_gpu("zero-copy", big, gpu)["predicted_s"] == pytest.approx(
        2 * big_copy + 2e-3)
    assert predict_one_gpu("zero-copy", big, replace(gpu, checked_from=None))[
        "predicted_s"] == pytest.approx(2 * big_copy + 2 * big_check + 2e-3)
    assert predict_one_gpu("packed", big, gpu, bucket_bytes=nb, num_buffers=1)[
        "predicted_s"] == pytest.approx(2 * (big_copy + 1e-3 + big_copy) + 2e-3)
    # ... but M->N pieces read in place are all checked after their copies
    assert predict_one_gpu("m2n-in-place", big, gpu, senders=2)["predicted_s"] == \
        pytest.approx(2 * big_copy + 2 * big_check + 1e-3 + 2e-3)
    # a tensor split over buckets is checked after its copy
    assert predict_one_gpu("packed", big, gpu, bucket_bytes=nb // 2, num_buffers=1)[
        "predicted_s"] > predict_one_gpu("packed", big, replace(gpu, check_bandwidth=None),
                                         bucket_bytes=nb // 2, num_buffers=1)["predicted_s"]
