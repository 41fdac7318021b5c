"""AsyncEngine on the tiny model: pause modes, weight updates, versions, invariance, checkpoints."""

import asyncio

import pytest
import torch
from engine_helpers import GREEDY, collect, run, until
from wtransfer_ipc import IPCTrainerInitInfo

import wtransfer
from wtransfer.errors import ConfigError, LifecycleError
from wtransfer.inference import (
    AsyncEngine,
    EngineConfig,
    LocalEngineClient,
    SamplingParams,
    WeightVersionSpan,
    load_model,
    save_pretrained,
)


def prompts(n):
    return {f"r{i}": [(7 * i + j) % 256 for j in range(3 + i % 5)] for i in range(n)}


def test_keep_pause_freezes_every_request_and_they_continue_after_resume():
    async def main():
        engine = AsyncEngine(EngineConfig(model="tiny"))
        reference = {rid: await collect(engine, rid, p) for rid, p in prompts(12).items()}
        progress = {}
        tasks = {rid: asyncio.create_task(collect(engine, rid, p, GREEDY, progress))
                 for rid, p in prompts(12).items()}
        await until(lambda: len(progress) == 12 and min(progress.values()) >= 2)
        await engine.pause_generation(mode="keep", clear_cache=False)
        assert await engine.is_paused()
        frozen = dict(progress)
        await asyncio.sleep(0.05)
        assert progress == frozen and not any(t.done() for t in tasks.values())
        await engine.resume_generation()
        outs = {rid: await t for rid, t in tasks.items()}
        engine.shutdown()
        for rid, out in outs.items():
            assert out.outputs[0].finish_reason == "length"
            assert out.outputs[0].token_ids == reference[rid].outputs[0].token_ids
    run(main())


def test_abort_pause_ends_live_requests_with_partial_tokens_and_holds_new_ones():
    async def main():
        engine = AsyncEngine(EngineConfig(model="tiny"))
        progress = {}
        tasks = [asyncio.create_task(collect(engine, rid, p, GREEDY, progress))
                 for rid, p in prompts(8).items()]
        await until(lambda: len(progress) == 8)
        await engine.pause_generation(mode="abort")
        outs = await asyncio.gather(*tasks)
        assert all(o.outputs[0].finish_reason == "abort" for o in outs)
        assert all(0 < len(o.outputs[0].token_ids) < 24 for o in outs)
        late = asyncio.create_task(collect(engine, "late", [1, 2, 3]))
        await asyncio.sleep(0.05)
        assert not late.done()
        assert await engine.abort_requests(["late"]) == 1  # abort while paused
        assert (await late).outputs[0].finish_reason == "abort"
        again = asyncio.create_task(collect(engine, "again", [1, 2, 3]))
        await engine.resume_generation()
        assert (await again).outputs[0].finish_reason == "length"
        engine.shutdown()
    run(main())


def test_wait_pause_returns_once_running_requests_finished():
    async def main():
        engine = AsyncEngine(EngineConfig(model="tiny"))
        progress = {}
        tasks = [asyncio.create_task(collect(engine, rid, p, GREEDY, progress))
                 for rid, p in prompts(6).items()]
        await until(lambda: len(progress) == 6)
        await engine.pause_generation(mode="wait")
        assert all(t.done() for t in tasks)
        assert all(t.result().outputs[0].finish_reason == "length" for t in tasks)
        held = asyncio.create_task(collect(engine, "held", [5, 6]))
        await asyncio.sleep(0.05)
        assert not held.done()
        await engine.resume_generation()
        assert len((await held).outputs[0].token_ids) == 24
        engine.shutdown()
    run(main())


def test_pause_when_idle_resume_when_running_and_repeated_races():
    async def main():
        engine = AsyncEngine(EngineConfig(model="tiny"))
        await engine.resume_generation()  # not paused: a no-op
        await engine.pause_generation(mode="keep")  # idle
        await engine.resume_generation()
        task = asyncio.create_task(collect(engine, "x", [1, 2, 3],
                                           SamplingParams(max_tokens=200, temperature=0)))
        for i in range(40):
            await engine.pause_generation(mode=("keep", "wait", "keep")[i % 3] if i % 3 != 1
                                          else "keep", clear_cache=bool(i % 2))
            await engine.resume_generation()
        out = await task
        assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 200
        with pytest.raises(ConfigError, match="unknown pause mode"):
            await engine.pause_generation(mode="freeze")
        engine.shutdown()
    run(main())


def test_an_in_place_update_is_refused_while_generating_unpaused():
    """update_staging='off': updates land in the live weights, so only paused or idle."""
    async def main():
        engine = AsyncEngine(EngineConfig(model="tiny", update_staging="off"))
        client = wtransfer.rpc.RPCClient(engine.serve_rpc(), timeout_s=30)
        loop = asyncio.get_running_loop()
        sender = await loop.run_in_executor(None, lambda: wtransfer.trainer_init(
            IPCTrainerInitInfo(bucket_bytes=1 << 16), client=client,
            source=wtransfer.ModuleSource(load_model("tiny", seed=5))))
        task = asyncio.create_task(collect(engine, "x", [1, 2],
                                           SamplingParams(max_tokens=300, temperature=0)))
        await until(lambda: engine.core.replica.scheduler.running)
        with pytest.raises(LifecycleError, match="pause_generation"):
            await engine.start_weight_update()
        await engine.pause_generation(mode="keep")
        await loop.run_in_executor(None, sender.send_weights, "v2")  # paused: allowed
        await engine.resume_generation()
        out = await task
        spans = out.outputs[0].weight_versions
        assert [s.version for s in spans] == ["default", "v2"] and spans[-1].end == 300
        sender.shutdown()
        engine.shutdown()
    run(main())


def test_batch_invariant_tokens_do_not_depend_on_batch_mates():
    async def main():
        engine = AsyncEngine(EngineConfig(model="tiny", batch_invariant=True))
        alone = await collect(engine, "solo", [4, 8, 15, 16, 23, 42])
        crowd = [asyncio.create_task(collect(engine, f"c{i}", p))
                 for i, p in enumerate(prompts(10).values())]
        together = asyncio.create_task(collect(engine, "solo2", [4, 8, 15, 16, 23, 42]))
        await asyncio.gather(*crowd)
        assert (await together).outputs[0].token_ids == alone.outputs[0].token_ids
        engine.shutdown()
    run(main())


def test_small_kv_pool_preempts_and_every_request_still_completes():
    async def main():
        engine = AsyncEngine(EngineConfig(model="tiny", num_kv_blocks=12, block_size=4))
        outs = await asyncio.gather(*[collect(engine, rid, p) for rid, p in prompts(8).items()])
        stats = await engine.stats()
        engine.shutdown()
        assert all(len(o.outputs[0].token_ids) == 24 for o in outs)
        assert stats["preemptions"] > 0
    run(main())


def test_prefix_cache_hits_for_a_shared_prompt():
    async def main():
        engine = AsyncEngine(EngineConfig(model="tiny", block_size=4))
        shared = list(range(40))
        first = await collect(engine, "a", shared)
        second = await collect(engine, "b", shared)
        stats = await engine.stats()
        engine.shutdown()
        assert stats["prefix_cache_hits"] >= 9
        assert first.outputs[0].token_ids == second.outputs[0].token_ids
    run(main())


def test_checkpoint_round_trip_is_bit_exact(tmp_path):
    for name in ("tiny", "small"):
        model = load_model(name, seed=3)
        back = load_model(str(save_pretrained(model, tmp_path / name)))
        assert wtransfer.fingerprint(back.state_dict()) == wtransfer.fingerprint(
            model.state_dict())
    with pytest.raises(ConfigError, match="unknown model"):
        load_model(str(tmp_path / "missing"))


def test_fused_checkpoint_names_are_split_onto_the_model():
    model = load_model("tiny", seed=1)
    other = load_model("tiny", seed=2)
    p = "model.layers.0."
    sd = model.state_dict()
    fused = {
        p + "self_attn.qkv_proj.weight": torch.cat([sd[p + f"self_attn.{x}_proj.weight"]
                                                    for x in "qkv"]),
        p + "mlp.gate_up_proj.weight": torch.cat([sd[p + "mlp.gate_proj.weight"],
                                                  sd[p + "mlp.up_proj.weight"]]),
    }
    other.load_weights(fused.items())
    for name in ("self_attn.q_proj", "self_attn.v_proj", "mlp.up_proj"):
        assert torch.equal(other.state_dict()[p + name + ".weight"], sd[p + name + ".weight"])


def test_version_label_and_spans_without_updates():
    async def main():
        engine = AsyncEngine(EngineConfig(model="tiny"))
        assert await engine.get_weight_version() == "default"
        out = await collect(engine, "a", [1, 2, 3], SamplingParams(max_tokens=5, temperature=0))
        assert out.outputs[0].weight_versions == [WeightVersionSpan("default", 0, 5)]
        await engine.update_weight_version("v8")
        assert await engine.get_weight_version() == "v8"
        assert engine.core.replica.weight_version == "v8"  # the core drives one replica
        with pytest.warns(DeprecationWarning, match=r"read core\.replica\.weight_version"):
            assert engine.core.weight_version == "v8"  # (read through, as before, deprecated)
        engine.shutdown()
    run(main())


def test_in_process_update_through_ipc_changes_the_served_weights():
    async def main():
        engine = AsyncEngine(EngineConfig(model="tiny"))
        trainer = load_model("tiny", seed=9)
        address = engine.serve_rpc()
        client = wtransfer.rpc.RPCClient(address, timeout_s=30)
        loop = asyncio.get_running_loop()

        def push():
            with wtransfer.trainer_init(IPCTrainerInitInfo(bucket_bytes=1 << 16), client=client,
                                        source=wtransfer.ModuleSource(trainer)) as sender:
                sender.send_weights(weight_version="step-1")

        await loop.run_in_executor(None, push)
        assert await engine.fingerprint() == wtransfer.fingerprint(trainer.state_dict())
        assert await engine.get_weight_version() == "step-1"
        engine.shutdown()
    run(main())


@pytest.mark.parametrize("rollback", [False, True])
def test_a_failed_update_keeps_the_label_and_is_torn_or_rolled_back(rollback):
    async def main():
        engine = AsyncEngine(EngineConfig(model="tiny", update_rollback=rollback,
                                          update_staging="off"))
        before = await engine.fingerprint()
        client = wtransfer.rpc.RPCClient(engine.serve_rpc(), timeout_s=30)
        trainer = load_model("tiny", seed=4)
        loop = asyncio.get_running_loop()

        class Failing(wtransfer.ModuleSource):
            def tensors(self):
                for i, item in enumerate(super().tensors()):
                    if i == 10:
                        raise RuntimeError("trainer lost a shard")
                    yield item

        sender = await loop.run_in_executor(None, lambda: wtransfer.trainer_init(
            IPCTrainerInitInfo(bucket_bytes=4096), client=client, source=Failing(trainer)))
        await engine.pause_generation(mode="keep")
        with pytest.raises(RuntimeError, match="lost a shard"):
            await loop.run_in_executor(None, sender.send_weights, "bad")
        assert await engine.get_weight_version() == "default"
        if rollback:  # the old weights are back: the engine may serve them at once
            assert await engine.fingerprint() == before
            await engine.resume_generation()
            await engine.pause_generation(mode="keep")
        else:
            with pytest.raises(LifecycleError, match="refusing to resume"):
                await engine.resume_generation()
        sender.source = wtransfer.ModuleSource(trainer)
        await loop.run_in_executor(None, sender.send_weights, "good")
        await engine.resume_generation()
        assert await engine.get_weight_version() == "good"
        assert await engine.fingerprint() == wtransfer.fingerprint(trainer.state_dict())
        sender.shutdown()
        engine.shutdown()
    run(main())


def test_an_update_abandoned_by_its_sender_cannot_hold_the_engine():
    """An in-place update holds the steps while open; its sender's silence ends it."""
    async def main():
        engine = AsyncEngine(EngineConfig(model="tiny", update_staging="off"))
        client = LocalEngineClient(engine)
        loop = asyncio.get_running_loop()
        sender = await loop.run_in_executor(None, lambda: wtransfer.trainer_init(
            IPCTrainerInitInfo(timeout_s=0.3), client=client,
            source=wtransfer.ModuleSource(load_model("tiny", seed=2))))
        await loop.run_in_executor(None, client.start_weight_update)  # ...and the sender is gone
        task = asyncio.create_task(collect(engine, "x", [1, 2, 3]))
        out = await asyncio.wait_for(task, 30)  # waits for the deadline, then generates
        assert out.outputs[0].finish_reason == "length"
        assert engine.core.replica.receiver.state == "failed"
        assert "abandoned" in engine.core.replica.receiver.failure
        sender.shutdown()
        engine.shutdown()
    run(main())


def test_a_rollback_setting_that_is_not_a_bool_is_refused():
    """A string such as "off" would be truthy: refused, naming the values allowed."""
    with pytest.raises(ConfigError, match="update_rollback must be True, False or None"):
        EngineConfig(model="tiny", update_rollback="off")


def test_batched_steps_give_the_tokens_of_each_sequence_computed_alone():
    """Steps that batch decoding sequences with prefilling ones (staggered arrivals, prompts
    of different lengths, shared prefixes served from the prefix cache) give every request
    the tokens it gets computed on its own (float32: the kernels' rounding never decides a
    greedy token here)."""
    async def main():
        batched = AsyncEngine(EngineConfig(model="tiny", block_size=4))
        alone = AsyncEngine(EngineConfig(model="tiny", batch_invariant=True))
        shared = [(3 * j) % 256 for j in range(13)]
        requests = {f"r{i}": (shared if i % 3 == 0 else [])
                    + [(7 * i + j) % 256 for j in range(1 + i % 6)] for i in range(10)}

        async def staggered(rid, prompt, delay):
            await asyncio.sleep(delay)
            return await collect(batched, rid, prompt)

        outs = await asyncio.gather(*(staggered(rid, p, 0.003 * i)
                                      for i, (rid, p) in enumerate(requests.items())))
        stats = await batched.stats()
        for (rid, prompt), out in zip(requests.items(), outs, strict=True):
            want = await collect(alone, rid, prompt)
            assert out.outputs[0].token_ids == want.outputs[0].token_ids, rid
        assert stats["prefix_cache_hits"] > 0
        batched.shutdown()
        alone.shutdown()
    run(main())


def test_a_reader_that_falls_behind_gets_the_latest_output_holding_every_token():
    """A reader that stops reading while the engine goes on is handed the newest cumulative
    output in place of those it missed: its tokens, logprobs and spans equal those of a
    reader that kept up (greedy, same prompt), and the last output is the finished one."""
    async def main():
        engine = AsyncEngine(EngineConfig(model="tiny"))
        params = SamplingParams(max_tokens=24, temperature=0)
        kept_up = await collect(engine, "a", [5, 6, 7], params)
        seen = []
        async for out in engine.generate([5, 6, 7], params, request_id="b"):
            seen.append(out)
            if len(seen) == 1:
                await until(lambda: engine.core.replica.tokens_generated >= 48,
                            "the engine to finish the request meanwhile")
        engine.shutdown()
        assert len(seen) < 24 and seen[-1].finished
        assert len(seen[1].outputs[0].token_ids) > len(seen[0].outputs[0].token_ids) + 1
        last, want = seen[-1].outputs[0], kept_up.outputs[0]
        assert (last.token_ids, last.logprobs, last.weight_versions, last.finish_reason) == (
            want.token_ids, want.logprobs, want.weight_versions, want.finish_reason)
    run(main())


def test_a_request_id_used_again_right_after_its_reader_left_gets_only_its_own_outputs():
    """A reader that leaves aborts its request; the same id asked again at once is refused
    while that abort is pending and then runs as a request of its own: its outputs are its
    own tokens to the end, none of the aborted request's."""
    async def main():
        engine = AsyncEngine(EngineConfig(model="tiny"))
        short = SamplingParams(max_tokens=8, temperature=0)
        want = await collect(engine, "ref", [9, 8, 7], short)
        async for _ in engine.generate([1, 2, 3], SamplingParams(max_tokens=40), "x"):
            break  # the reader leaves: the request is aborted
        refused = 0
        while True:
            try:
                got = await collect(engine, "x", [9, 8, 7], short)
                break
            except ConfigError:  # (the id is taken until the abort ran)
                refused += 1
                await asyncio.sleep(0.002)
        engine.shutdown()
        assert got.outputs[0].token_ids == want.outputs[0].token_ids, refused
        assert got.outputs[0].finish_reason == "length" and got.prompt_token_ids == [9, 8, 7]
    run(main())
