"""Decode steps replayed as CUDA graphs (`wtransfer.inference.steps.decode_graphs`).

On the host the padded static layout runs eagerly (no capture): its tokens must be the eager
path's, across batch and context buckets. On CUDA the same tests capture real graphs, and a
staged swap commit (which moves the weights' addresses) must not leave a graph reading the old
weights. An engine's shutdown gives its device memory back.
"""

import asyncio

import pytest
import torch
from engine_helpers import GREEDY, collect, run, tokens_of
from wtransfer_ipc import IPCTrainerInitInfo

import wtransfer
from wtransfer.inference import AsyncEngine, EngineConfig, LocalEngineClient
from wtransfer.inference.model.decoder import load_model
from wtransfer.inference.steps.decode_graphs import DecodeGraphs

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def engine_on(device, *, graphs, **config):
    """A tiny float32 engine; on the host with `graphs`, the static layout replayed eagerly
    (nothing is captured there, so only the CUDA variants can catch a graph replayed over
    addresses the weights left)."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    engine = AsyncEngine(EngineConfig(model="tiny", device=device, cuda_graphs=graphs,
                                      **config))
    runner = engine.core.replica.runner
    if graphs and device == "cpu":
        staging = engine.core.replica.staging  # (as the engine's runner is given it)
        runner.graphs = DecodeGraphs(runner.model, runner.kv, block_size=16,
                                     scratch_block=runner.num_blocks,
                                     zero_slot=runner.zero_slot,
                                     max_seqs=engine.core.config.max_num_seqs,
                                     longest_context=2048, epoch=engine.core.replica._weights_epoch,
                                     capture=False, other_weights=(
                                         staging.other_weights if staging is not None
                                         else None))
    assert (runner.graphs is not None) == graphs
    return engine


def requests(n):
    """Prompts of several lengths; the last one long enough that its context crosses the
    first context bucket (256) while it decodes."""
    out = {f"r{i}": [(11 * i + 3 * j) % 256 for j in range(2 + i % 7)] for i in range(n - 1)}
    out["long"] = [(5 * j) % 256 for j in range(250)]
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("batch", [5, 12])
def test_decode_graphs_give_the_eager_tokens(device, batch):
    async def main():
        eager, graphed = (engine_on(device, graphs=False), engine_on(device, graphs=True))
        try:
            prompts = requests(batch)
            want = await tokens_of(eager, prompts)
            assert await tokens_of(graphed, prompts) == want
            graphs = graphed.core.replica.runner.graphs
            assert graphs.disabled is None
            buckets = set(graphs._graphs)
            assert {c for _, c in buckets} == {256, 512}, buckets  # the long one moved on
            assert {b for b, _ in buckets} >= {8 if batch == 5 else 16}, buckets
        finally:
            eager.shutdown()
            graphed.shutdown()
    run(main())


@pytest.mark.parametrize("device", DEVICES)
def test_a_swap_commit_makes_graphs_read_the_new_weights(device):
    """After a staged swap commit the decode graphs replayed are those captured for the
    shadow's storages before the update wrote them: the tokens are those of a fresh engine
    holding the new weights, never of the old ones."""
    async def main():
        engine = engine_on(device, graphs=True, update_staging="swap")
        fresh = engine_on(device, graphs=False, seed=1)
        try:
            prompts = requests(4)
            before = await tokens_of(engine, prompts)
            graphs = engine.core.replica.runner.graphs
            built, present = graphs.built, graphs._graphs
            trainer = load_model("tiny", seed=1)
            client = LocalEngineClient(engine)
            with wtransfer.trainer_init(IPCTrainerInitInfo(timeout_s=60), client=client,
                                        source=wtransfer.ModuleSource(trainer)) as sender:
                await asyncio.to_thread(sender.send_weights, "v1")
            after = await tokens_of(engine, prompts)
            assert after == await tokens_of(fresh, prompts) and after != before
            assert graphs._graphs is not present and graphs.built == built
        finally:
            engine.shutdown()
            fresh.shutdown()
    run(main())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("staging", ["swap", "copy"])
def test_staged_updates_that_replay_their_copies_land_bit_exact(device, staging):
    """Five staged updates from a trainer on the engine's device, each of new weights: from
    the third (swap: each set of shadow storages its second time; copy: the second) they
    replay the copies worked out before (on CUDA as a captured graph); every update leaves the
    engine holding the trainer's weights, and its tokens are a fresh engine's."""
    async def main():
        engine = engine_on(device, graphs=device == "cuda", update_staging=staging)
        trainer = load_model("tiny", seed=1, device=device)
        client = LocalEngineClient(engine)
        prompts = requests(3)
        try:
            with wtransfer.trainer_init(IPCTrainerInitInfo(timeout_s=60), client=client,
                                        source=wtransfer.ModuleSource(trainer)) as sender:
                for step in range(5):
                    with torch.no_grad():
                        for param in trainer.parameters():
                            param.add_(torch.randn_like(param) * 0.01)
                    await asyncio.to_thread(sender.send_weights, f"v{step}")
                    held = await asyncio.to_thread(client.fingerprint)
                    assert held == wtransfer.fingerprint(trainer.state_dict()), step
            fresh = engine_on(device, graphs=False, seed=1)
            try:
                fresh.core.replica.runner.model.load_state_dict(trainer.state_dict())
                assert await tokens_of(engine, prompts) == await tokens_of(fresh, prompts)
            finally:
                fresh.shutdown()
        finally:
            engine.shutdown()
    run(main())


@pytest.mark.gpu
def test_shutdown_gives_the_device_memory_back():
    """Engines created and shut down one after another (their objects kept, as a caller
    may) leave the allocator where the first left it; the first leaves at most the process's
    one cuBLAS workspace of the graphs' capture stream (32 MiB on an H100)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    engine = AsyncEngine(EngineConfig(model="small", device="cuda", update_staging="swap"))
    run(collect(engine, "r", [1, 2, 3], GREEDY))
    engine.shutdown()
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    assert start - before <= 64 << 20, start - before
    kept = [engine]
    for _ in range(3):
        engine = AsyncEngine(EngineConfig(model="small", device="cuda", update_staging="swap"))
        run(collect(engine, "r", [1, 2, 3], GREEDY))
        assert torch.cuda.memory_allocated() > start
        engine.shutdown()
        kept.append(engine)
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() <= start + (1 << 20), (
            torch.cuda.memory_allocated() - start)


@pytest.mark.parametrize("device", DEVICES)
def test_buckets_are_captured_for_both_address_sets_and_never_at_a_commit(device):
    """A swap alternates the weights between two sets of storages, and each bucket is captured
    for both when first used: the steps after every commit (and after a rollback) replay graphs
    captured before it, reading the new values: tokens of a fresh engine with those weights."""
    async def main():
        engine = engine_on(device, graphs=True, update_staging="swap")
        client = LocalEngineClient(engine)
        try:
            prompts = requests(4)
            await tokens_of(engine, prompts)
            graphs = engine.core.replica.runner.graphs
            first_set = graphs._graphs
            buckets = set(first_set)
            assert graphs.built == 2 * len(buckets) and len(graphs._sets) == 2
            trainer = load_model("tiny", seed=1)
            with wtransfer.trainer_init(IPCTrainerInitInfo(timeout_s=60), client=client,
                                        source=wtransfer.ModuleSource(trainer)) as sender:
                await asyncio.to_thread(sender.send_weights, "v1")
                middle = await tokens_of(engine, prompts)
                second_set = graphs._graphs
                assert second_set is not first_set  # (new addresses: the other set)
                with torch.no_grad():
                    for p in trainer.parameters():
                        p.mul_(-0.5)
                await asyncio.to_thread(sender.send_weights, "v2")
            after = await tokens_of(engine, prompts)
            assert after != middle and graphs.disabled is None
            assert graphs._graphs is first_set  # (back where the first graphs read)
            buckets = set(first_set) | set(second_set)
            assert set(first_set) == set(second_set) == buckets
            assert graphs.built == 2 * len(buckets)  # (no bucket captured twice for a set)
            fresh = engine_on(device, graphs=False)
            try:
                await asyncio.to_thread(fresh.core.replica.model.load_state_dict,
                                        trainer.state_dict())
                assert after == await tokens_of(fresh, prompts)
            finally:
                fresh.shutdown()
            await engine.rollback_weights()
            assert await tokens_of(engine, prompts) == middle
            assert graphs._graphs is second_set and graphs.disabled is None
            assert graphs.built == 2 * len(set(first_set) | set(second_set))
        finally:
            engine.shutdown()
    run(main())


@pytest.mark.parametrize("device", DEVICES)
def test_a_bucket_used_while_the_weights_are_read_is_captured_for_the_other_set_later(device):
    """While something reads the live weights off the engine thread (an update levelling the
    shadow, a push), the shadow is not put in their place: a bucket first used then is
    captured for the present set only, and for the other set on a later step."""
    async def main():
        engine = engine_on(device, graphs=True, update_staging="swap")
        try:
            staging = engine.core.replica.staging
            graphs = engine.core.replica.runner.graphs
            prompts = requests(4)
            with staging.lock:
                first = await tokens_of(engine, prompts)
            buckets = set(graphs._graphs)
            assert graphs._pending == buckets and len(graphs._sets) == 1
            assert await tokens_of(engine, prompts) == first
            assert not graphs._pending and len(graphs._sets) == 2
            assert all(set(kept) == buckets for kept in graphs._sets.values())
            assert graphs.built == 2 * len(buckets)
        finally:
            engine.shutdown()
    run(main())
