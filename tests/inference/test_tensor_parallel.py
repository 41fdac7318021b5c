"""Tensor and expert parallelism: N real worker processes per replica (gloo on CPU).

Checkpoints are built with transformers at test time (Qwen3 dense and Qwen3-MoE, fp32); what is
checked is what a user would see: greedy tokens equal to transformers' own and to TP=1, every
worker holding its own part (experts disjoint with expert parallelism), updates from a trainer
that land in every worker (fingerprints of the full tensors), mid-flight updates whose tails
equal a fresh engine, and an engine that reports dead, without hanging, when a worker dies.
"""

import asyncio
import os
import signal

import pytest
import torch
from engine_helpers import collect, run, until
from wtransfer_ipc import IPCTrainerInitInfo
from wtransfer_nccl import NCCLTrainerInitInfo
from wtransfer_ucx import UCXTrainerInitInfo

import wtransfer
from wtransfer.errors import ConfigError, EngineDeadError, LifecycleError
from wtransfer.inference import (
    AsyncEngine,
    EngineConfig,
    LocalEngineClient,
    SamplingParams,
    WeightVersionSpan,
)
from wtransfer.inference.model.decoder import load_model

PROMPTS = [[1, 2, 3], [7, 8, 9, 10], [42]]
SHAPE = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, intermediate_size=128,
             max_position_embeddings=512, tie_word_embeddings=False)


def hf_checkpoint(path, moe, seed=0):
    """A random transformers Qwen3 (or Qwen3-MoE: 4 experts, 2 per token) saved at `path`;
    returns the transformers model."""
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    if moe:
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**SHAPE, num_experts=4, num_experts_per_tok=2,
                                                   moe_intermediate_size=32,
                                                   norm_topk_prob=True))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**SHAPE))
    model.eval().save_pretrained(path)
    return model


def hf_greedy(model, prompt, n):
    """transformers' greedy tokens: argmax of each full forward."""
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            tokens.append(int(model(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(prompt):]


async def greedy(engine, n=16, prompts=PROMPTS):
    outs = []
    for i, prompt in enumerate(prompts):
        out = await collect(engine, f"g{i}", prompt, SamplingParams(max_tokens=n, temperature=0))
        outs.append(out.outputs[0].token_ids)
    return outs


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {moe: (root / ("moe" if moe else "dense"), hf_checkpoint(root / ("moe" if moe else
                                                                          "dense"), moe))
            for moe in (False, True)}


@pytest.mark.parametrize(("moe", "expert"), [(False, False), (True, False), (True, True)],
                         ids=["dense", "moe-tp", "moe-ep"])
def test_two_workers_generate_what_transformers_and_one_worker_generate(checkpoints, moe,
                                                                        expert):
    """TP=2 (MoE: experts split by width, or by expert) on a transformers checkpoint: greedy
    tokens equal transformers' and TP=1's; the fingerprint (full tensors assembled from the
    workers) equals the checkpoint's; each worker keeps half the bytes; with expert
    parallelism the workers hold disjoint halves of the experts."""
    path, hf = checkpoints[moe]
    want = [hf_greedy(hf, p, 16) for p in PROMPTS]

    async def main():
        one = AsyncEngine(EngineConfig(model=str(path)))
        try:
            assert await greedy(one) == want
        finally:
            one.shutdown()
        two = AsyncEngine(EngineConfig(model=str(path), tensor_parallel_size=2,
                                       enable_expert_parallel=expert))
        try:
            assert await greedy(two) == want
            assert await two.fingerprint() == wtransfer.fingerprint(hf.state_dict())
            workers = (await two.weight_info())["workers"]
            total = sum(t.numel() * t.element_size() for t in hf.state_dict().values())
            assert [w["worker"] for w in workers] == [0, 1]
            assert sum(w["kept_bytes"] for w in workers) < 1.1 * total  # norms are replicated
            assert all(w["kept_bytes"] < 0.6 * total for w in workers)
            if expert:
                held = [lay["model.layers.0.mlp.experts.gate_up_proj"].boxes
                        for lay in two.core.replica.workers.layouts]
                assert [[(b.offsets[0], b.lengths[0]) for b in boxes] for boxes in held] == \
                    [[(0, 2)], [(2, 2)]]  # experts 0-1 on worker 0, 2-3 on worker 1
        finally:
            two.shutdown()

    run(main(), deadline_s=240)


def test_a_model_that_does_not_split_evenly_is_refused_at_start_up():
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=3 must divide"):
        AsyncEngine(EngineConfig(model="tiny", tensor_parallel_size=3))


@pytest.mark.parametrize(("staging", "backend"), [
    ("off", "ipc"), ("swap", "ipc"), ("off", "nccl"), ("swap", "nccl"), ("off", "ucx")])
def test_an_update_mid_flight_reaches_every_worker(backend, staging):
    """A trainer's update into a TP=2 engine while greedy requests run (in place: a keep
    pause around it; staged: no pause): both workers hold the trainer's weights (their full
    tensors' fingerprint equals the trainer's), each received only the parts it keeps (by
    default, from one sender), and every request's
    tail after the update equals a fresh TP=1 engine holding the new weights."""
    max_tokens = 48

    async def main():
        engine = AsyncEngine(EngineConfig(model="tiny", tensor_parallel_size=2,
                                          batch_invariant=True, update_staging=staging,
                                          weight_transfer_backend=backend))
        trainer = load_model("tiny", seed=3)
        try:
            progress = {}
            greedy_params = SamplingParams(max_tokens=max_tokens, temperature=0)
            tasks = {f"r{i}": asyncio.create_task(collect(engine, f"r{i}", p, greedy_params,
                                                          progress))
                     for i, p in enumerate(PROMPTS)}
            await until(lambda: len(progress) == 3 and min(progress.values()) >= 3,
                        "every request to start")
            if staging == "off":
                await engine.pause_generation(mode="keep", clear_cache=True)
            info = {"nccl": NCCLTrainerInitInfo(master_address="127.0.0.1", world_size=3,
                                                timeout_s=60, bucket_bytes=1 << 16),
                    "ucx": UCXTrainerInitInfo(listen_address="127.0.0.1", timeout_s=60,
                                              bucket_bytes=1 << 16),
                    "ipc": IPCTrainerInitInfo(bucket_bytes=1 << 16, timeout_s=60)}[backend]
            client = LocalEngineClient(engine)
            assert client.num_workers() == 2

            def push():
                with wtransfer.trainer_init(info, client=client,
                                            source=wtransfer.ModuleSource(trainer)) as sender:
                    return sender.send_weights(weight_version="tp-1")

            stats = await asyncio.to_thread(push)
            if staging == "off":
                await engine.resume_generation()
            outs = {rid: await task for rid, task in tasks.items()}
            assert await engine.fingerprint() == wtransfer.fingerprint(trainer.state_dict())
            workers = (await engine.weight_info())["workers"]
            assert [w["update_state"] for w in workers] == ["ready", "ready"]
            assert all(w["last_update_bytes"] > 0 for w in workers)
            # by default one sender slices per worker (1->N), over either backend
            model_bytes = sum(t.numel() * t.element_size() for t in trainer.state_dict().values())
            kept = [w["kept_bytes"] for w in workers]
            assert [w["last_update_bytes"] for w in workers] == kept
            assert all(k < 0.6 * model_bytes for k in kept), (kept, model_bytes)
            if backend != "ipc":  # a message per worker: each worker's bytes sent to it
                assert stats.worker_bytes == kept and stats.sent_bytes == sum(kept)
            # (ipc stages the model once in shared memory; each worker copies out its part)
        finally:
            engine.shutdown()
        fresh = AsyncEngine(EngineConfig(model="tiny", seed=3, batch_invariant=True))
        try:
            for i, (rid, out) in enumerate(outs.items()):
                done = out.outputs[0]
                old, new = done.weight_versions
                k = old.end
                assert old == WeightVersionSpan("default", 0, k) and k >= 3
                assert new == WeightVersionSpan("tp-1", k, max_tokens)
                tail = await collect(fresh, rid, PROMPTS[i] + done.token_ids[:k],
                                     SamplingParams(max_tokens=max_tokens - k, temperature=0))
                assert tail.outputs[0].token_ids == done.token_ids[k:], rid
        finally:
            fresh.shutdown()

    run(main(), deadline_s=240)


def test_a_killed_worker_makes_the_engine_report_dead_without_hanging():
    """SIGKILL worker 1 while requests run: the engine notices at its next step, reports why,
    ends the requests with an error, and every later call fails at once."""
    async def main():
        engine = AsyncEngine(EngineConfig(model="tiny", tensor_parallel_size=2,
                                          step_timeout_s=20.0))
        try:
            running = asyncio.create_task(collect(
                engine, "victim", [3, 3], SamplingParams(max_tokens=1500, temperature=0)))
            await until(lambda: engine.core.replica.steps > 3, "steps to run")
            os.kill(engine.core.replica.workers.procs[0].pid, signal.SIGKILL)
            out = await asyncio.wait_for(running, 60)
            assert out.outputs[0].finish_reason == "error"
            assert "tensor-parallel" in engine.failure()
            with pytest.raises(EngineDeadError):
                await engine.get_weight_version()
        finally:
            engine.shutdown()

    run(main(), deadline_s=120)


def test_data_parallel_ranks_of_two_workers_each_take_an_update():
    """DP=2 x TP=2 (four workers): a staged update reaches all four, and greedy tokens equal a
    single TP=1 engine holding the same weights."""
    async def main():
        engine = AsyncEngine(EngineConfig(model="tiny", data_parallel_size=2,
                                          tensor_parallel_size=2, batch_invariant=True,
                                          dp_sync_interval=8, step_timeout_s=60.0))
        trainer = load_model("tiny", seed=4)
        try:
            client = LocalEngineClient(engine)
            assert client.num_workers() == 4
            with wtransfer.trainer_init(IPCTrainerInitInfo(bucket_bytes=1 << 16), client=client,
                                        source=wtransfer.ModuleSource(trainer)) as sender:
                await asyncio.to_thread(sender.send_weights, "dp-tp")
            assert await engine.fingerprint() == wtransfer.fingerprint(trainer.state_dict())
            workers = (await engine.weight_info())["workers"]
            assert sorted(w["worker"] for w in workers) == [0, 1, 2, 3]
            got = await greedy(engine, 12)
        finally:
            engine.shutdown()
        single = AsyncEngine(EngineConfig(model="tiny", seed=4, batch_invariant=True))
        try:
            assert got == await greedy(single, 12)
        finally:
            single.shutdown()

    run(main(), deadline_s=300)


def test_an_engine_idle_for_longer_than_its_step_timeout_still_serves():
    """Workers wait for rank 0 within step_timeout_s; an idle rank 0 keeps them company, so
    an engine left alone for three deadlines still generates (and then still updates)."""
    async def main():
        engine = AsyncEngine(EngineConfig(model="tiny", tensor_parallel_size=2,
                                          batch_invariant=True, step_timeout_s=2.0))
        try:
            await asyncio.sleep(6.0)
            assert engine.failure() is None
            got = await greedy(engine, 8)
        finally:
            engine.shutdown()
        single = AsyncEngine(EngineConfig(model="tiny", batch_invariant=True))
        try:
            assert got == await greedy(single, 8)
        finally:
            single.shutdown()

    run(main(), deadline_s=120)


def test_a_rollback_a_worker_cannot_do_leaves_every_rank_as_it_was():
    """TP=2, staged swap updates: a rollback brings the previous version back on both workers
    (the full tensors' fingerprint); one that worker 1 cannot do (its previous version gone,
    as an update start that reached only it leaves it) is refused with that worker's reason,
    and no rank rolled back: the engine still holds the last update whole, with its label."""
    async def main():
        engine = AsyncEngine(EngineConfig(model="tiny", tensor_parallel_size=2,
                                          update_staging="swap"))
        client = LocalEngineClient(engine)

        def push(model, version):
            with wtransfer.trainer_init(IPCTrainerInitInfo(bucket_bytes=1 << 16, timeout_s=60),
                                        client=client,
                                        source=wtransfer.ModuleSource(model)) as sender:
                sender.send_weights(weight_version=version)

        def start_on_workers_only():
            workers = engine.core.replica.workers
            workers.wait(workers.call_all("start_weight_update", []), "start")
            workers.wait(workers.call_all("discard_weight_update", ["a test"]), "discard")

        try:
            original = await engine.fingerprint()
            first, second = load_model("tiny", seed=1), load_model("tiny", seed=2)
            await asyncio.to_thread(push, first, "v1")
            await engine.rollback_weights()
            assert await engine.fingerprint() == original
            assert await engine.get_weight_version() == "default"
            await asyncio.to_thread(push, first, "v1")
            await asyncio.to_thread(push, second, "v2")
            await asyncio.to_thread(start_on_workers_only)
            with pytest.raises(LifecycleError, match="no rank rolled back: tensor-parallel "
                                                     "worker 1: no previous weight version"):
                await engine.rollback_weights()
            assert await engine.fingerprint() == wtransfer.fingerprint(second.state_dict())
            assert await engine.get_weight_version() == "v2"
            greedy_params = SamplingParams(max_tokens=8, temperature=0)
            out = await collect(engine, "after", PROMPTS[0], greedy_params)
            assert [s.version for s in out.outputs[0].weight_versions] == ["v2"]
        finally:
            engine.shutdown()

    run(main(), deadline_s=180)


def test_a_refused_rollback_lets_every_worker_of_every_rank_go():
    """DP=2 x TP=2, staged swap updates: data-parallel rank 1 cannot roll back (its previous
    version gone), so rank 0 and its worker, which had reserved, let go and no weight moved;
    the next update then lands on all four workers (nothing left holding their weights) and
    a rollback brings all four back to the version before it."""
    async def main():
        engine = AsyncEngine(EngineConfig(model="tiny", data_parallel_size=2,
                                          tensor_parallel_size=2, update_staging="swap",
                                          dp_sync_interval=8, step_timeout_s=60.0))
        client = LocalEngineClient(engine)
        models = {v: load_model("tiny", seed=s) for v, s in (("v1", 1), ("v2", 2), ("v3", 3))}

        def push(version):
            with wtransfer.trainer_init(IPCTrainerInitInfo(bucket_bytes=1 << 16, timeout_s=60),
                                        client=client,
                                        source=wtransfer.ModuleSource(models[version])) as s:
                s.send_weights(weight_version=version)

        try:
            await asyncio.to_thread(push, "v1")
            await asyncio.to_thread(push, "v2")
            await asyncio.wrap_future(engine.core.rank_call(1, "start_weight_update"))
            await asyncio.wrap_future(engine.core.rank_call(1, "discard_weight_update", "test"))
            with pytest.raises(LifecycleError, match="no rank rolled back: data-parallel rank "
                                                     r"1: .*no previous weight version"):
                await engine.rollback_weights()
            assert await engine.fingerprint() == wtransfer.fingerprint(
                models["v2"].state_dict())
            await asyncio.to_thread(push, "v3")
            assert await engine.get_weight_version() == "v3"
            await engine.rollback_weights()
            assert await engine.fingerprint() == wtransfer.fingerprint(
                models["v2"].state_dict())
            assert await engine.get_weight_version() == "v2"
        finally:
            engine.shutdown()

    run(main(), deadline_s=240)
