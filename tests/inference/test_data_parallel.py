"""Data parallelism: N real rank processes in lockstep behind one AsyncEngine.

Every test runs under a deadline (a deadlock fails the test, it does not hang CI) and checks
what a user would notice: no request lost, kept requests continue, the weights every rank holds,
and the weight-version spans on every output.
"""

import asyncio
import os
import signal

import pytest
import torch
from engine_helpers import GREEDY, collect, run, until

import wtransfer
from wtransfer.errors import EngineDeadError, LifecycleError, PeerError
from wtransfer.inference import (
    AsyncEngine,
    EngineConfig,
    LocalEngineClient,
    SamplingParams,
    WeightVersionSpan,
)
from wtransfer.inference.model.decoder import load_model

SIZES = [2, 4]
SIZES_TWO_IN_CI = [2, pytest.param(4, marks=pytest.mark.extended)]
"""Checks whose four-rank run repeats the two-rank one at a width the CI run has no time for
(`make test-extended` runs it)."""


def dp_engine(size, **overrides):
    fields = {"model": "tiny", "data_parallel_size": size, "dp_sync_interval": 8,
              "batch_invariant": True, "step_timeout_s": 30.0, **overrides}
    return AsyncEngine(EngineConfig(**fields))


async def rank_stats(engine):
    return (await engine.stats())["ranks"]




@pytest.mark.parametrize("size", SIZES_TWO_IN_CI)
def test_requests_spread_over_every_rank_and_match_a_single_engine(size):
    async def main():
        engine = dp_engine(size)
        single = AsyncEngine(EngineConfig(model="tiny", batch_invariant=True))
        try:
            prompts = {f"r{i}": [(7 * i + j) % 256 for j in range(3 + i % 4)]
                       for i in range(3 * size)}
            outs = await asyncio.gather(*[collect(engine, rid, p, GREEDY)
                                          for rid, p in prompts.items()])
            ranks = await rank_stats(engine)
            assert all(r["tokens_generated"] > 0 for r in ranks), ranks
            for out in outs:
                reference = await collect(single, "ref", out.prompt_token_ids, GREEDY)
                assert out.outputs[0].token_ids == reference.outputs[0].token_ids
                assert out.outputs[0].weight_versions == [WeightVersionSpan("default", 0, 24)]
            with pytest.raises(wtransfer.errors.ConfigError, match="token ids"):
                await collect(engine, "bad", [999], GREEDY)
        finally:
            engine.shutdown()
            single.shutdown()

    run(main())


@pytest.mark.parametrize(("size", "mode"), [
    (2, "abort"), (2, "wait"), (2, "keep"),
    pytest.param(4, "keep", marks=pytest.mark.extended),
    pytest.param(4, "abort", marks=pytest.mark.extended),
    pytest.param(4, "wait", marks=pytest.mark.extended)])
def test_pause_with_one_rank_busy_and_the_others_idle(size, mode):
    """Rank 0 runs a request; every other rank is idle (not even in a wave) when the pause
    comes. The pause must hold within the deadline, with the mode's single-engine meaning."""

    async def main():
        engine = dp_engine(size)
        try:
            progress = {}
            params = SamplingParams(max_tokens=60 if mode == "wait" else 400, temperature=0.0)
            task = asyncio.create_task(collect(engine, "busy", [5, 6, 7], params, progress))
            await until(lambda: progress.get("busy", 0) >= 3, "the request to run")
            await asyncio.wait_for(engine.pause_generation(mode=mode, clear_cache=False), 30)
            ranks = await rank_stats(engine)
            assert all(r["global_paused"] and not r["in_wave"] for r in ranks), ranks
            if mode == "abort":
                out = await task
                assert out.outputs[0].finish_reason == "abort"
            elif mode == "wait":
                assert task.done() and (await task).outputs[0].finish_reason == "length"
            else:
                frozen = progress["busy"]
                steps = sum(r["steps"] for r in ranks)
                await asyncio.sleep(0.2)
                assert progress["busy"] == frozen and not task.done()
                assert sum(r["steps"] for r in await rank_stats(engine)) == steps
            await asyncio.wait_for(engine.resume_generation(), 30)
            out = await asyncio.wait_for(task, 60)
            expected = {"abort": "abort", "wait": "length", "keep": "length"}[mode]
            assert out.outputs[0].finish_reason == expected
            if mode == "keep":
                assert out.outputs[0].weight_versions == [WeightVersionSpan("default", 0, 400)]
            again = await collect(engine, "after", [1, 2], SamplingParams(max_tokens=4))
            assert again.outputs[0].finish_reason == "length"
        finally:
            engine.shutdown()

    run(main())


@pytest.mark.parametrize("size", SIZES_TWO_IN_CI)
def test_staggered_pause_and_a_new_request_while_the_pause_is_pending(size):
    """The pause reaches the idle ranks first and the busy rank last. Until the last rank has
    it, the busy rank keeps generating (the paused ranks keep joining its collectives) and the
    pause does not hold; a request routed to an already-paused rank must not run."""

    async def main():
        engine = dp_engine(size)
        dp = engine.core
        try:
            progress = {}
            busy = asyncio.create_task(collect(engine, "busy", [3, 1, 4], SamplingParams(
                max_tokens=1500, temperature=0.0), progress))
            await until(lambda: progress.get("busy", 0) >= 3, "the request to run")
            pending = [asyncio.wrap_future(dp.rank_call(r, "pause", "keep", False))
                       for r in range(1, size)]
            late = asyncio.create_task(collect(engine, "late", [2, 7], SamplingParams(
                max_tokens=8, temperature=0.0), progress))
            before = progress["busy"]
            await until(lambda: progress["busy"] >= before + 20, "rank 0 to keep generating")
            assert not any(p.done() for p in pending), "a pause held before every rank had it"
            assert progress.get("late", 0) == 0, "a request on a locally paused rank ran"
            ranks = await rank_stats(engine)
            assert ranks[1]["waiting"] == 1 and not any(r["global_paused"] for r in ranks)
            assert progress["busy"] < 1500, "make the busy request longer"
            pending.append(asyncio.wrap_future(dp.rank_call(0, "pause", "keep", False)))
            await asyncio.wait_for(asyncio.gather(*pending), 30)
            ranks = await rank_stats(engine)
            assert all(r["global_paused"] for r in ranks), ranks
            frozen = dict(progress)
            await asyncio.sleep(0.2)
            assert progress == frozen and not busy.done() and not late.done()
            await asyncio.wait_for(engine.resume_generation(), 30)
            outs = await asyncio.wait_for(asyncio.gather(busy, late), 90)
            assert [o.outputs[0].finish_reason for o in outs] == ["length", "length"]
        finally:
            engine.shutdown()

    run(main())


@pytest.mark.parametrize("size", SIZES_TWO_IN_CI)
def test_a_request_in_the_global_pause_starts_no_wave(size):
    async def main():
        engine = dp_engine(size)
        try:
            await engine.pause_generation(mode="keep")
            before = await rank_stats(engine)
            progress = {}
            task = asyncio.create_task(collect(engine, "q", [9, 9], GREEDY, progress))
            await asyncio.sleep(0.3)
            after = await rank_stats(engine)
            assert sum(r["waiting"] for r in after) == 1 and "q" not in progress
            for b, a in zip(before, after, strict=True):
                assert (a["steps"], a["dummy_steps"], a["waves_started"]) == \
                    (b["steps"], b["dummy_steps"], b["waves_started"]), (b, a)
            await engine.resume_generation()
            out = await asyncio.wait_for(task, 30)
            assert out.outputs[0].finish_reason == "length"
        finally:
            engine.shutdown()

    run(main())


def trainer_sender(engine, model):
    import wtransfer_ipc

    client = LocalEngineClient(engine)
    return wtransfer.trainer_init(wtransfer_ipc.IPCTrainerInitInfo(bucket_bytes=1 << 16),
                                  client=client, source=wtransfer.ModuleSource(model))


@pytest.mark.parametrize("size", SIZES_TWO_IN_CI)
def test_keep_pause_ipc_update_reaches_every_rank_and_spans_split_at_the_pause(size):
    """2 greedy requests per rank, keep + clear_cache pause mid-flight, seed-1 weights pushed
    over ipc: every rank holds them (fingerprints equal to the trainer's), and every request's
    later tokens equal a fresh single engine's on prompt + earlier tokens."""
    max_tokens = 20

    async def main():
        engine = dp_engine(size)
        trainer = load_model("tiny", seed=1)
        try:
            prompts = {f"r{i}": [(13 * i + 5 * j) % 256 for j in range(3 + i % 3)]
                       for i in range(2 * size)}
            progress = {}
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
            tasks = {rid: asyncio.create_task(collect(engine, rid, p, params, progress))
                     for rid, p in prompts.items()}
            await until(lambda: len(progress) == len(prompts) and min(progress.values()) >= 3,
                        "every request to start")
            await engine.pause_generation(mode="keep", clear_cache=True)
            with pytest.raises(LifecycleError, match="call init_weight_transfer_engine"):
                await engine.start_weight_update()

            def push():
                with trainer_sender(engine, trainer) as sender:
                    sender.send_weights(weight_version="v1")

            await asyncio.to_thread(push)
            expected = wtransfer.fingerprint(trainer.state_dict())
            for rank in range(size):
                assert await asyncio.wrap_future(
                    engine.core.rank_call(rank, "fingerprint")) == expected, rank
            assert await engine.fingerprint() == expected
            assert await engine.get_weight_version() == "v1"
            await engine.resume_generation()
            outs = {rid: await task for rid, task in tasks.items()}
        finally:
            engine.shutdown()
        fresh = AsyncEngine(EngineConfig(model="tiny", seed=1, batch_invariant=True))
        try:
            for rid, out in outs.items():
                done = out.outputs[0]
                old, new = done.weight_versions
                pre = old.end
                assert old == WeightVersionSpan("default", 0, pre) and pre >= 3
                assert new == WeightVersionSpan("v1", pre, max_tokens)
                reference = await collect(fresh, rid, prompts[rid] + done.token_ids[:pre],
                                          SamplingParams(max_tokens=max_tokens - pre,
                                                         temperature=0.0))
                assert reference.outputs[0].token_ids == done.token_ids[pre:], rid
        finally:
            fresh.shutdown()

    run(main())


def test_an_in_place_weight_update_needs_the_global_pause():
    async def main():
        engine = dp_engine(2, update_staging="off")
        try:
            sender = await asyncio.to_thread(trainer_sender, engine, load_model("tiny", seed=1))
            with sender, pytest.raises(LifecycleError, match="pause_generation"):
                await asyncio.to_thread(sender.send_weights, "v1")
            assert await engine.get_weight_version() == "default"
        finally:
            engine.shutdown()

    run(main())


def test_resume_is_all_or_nothing_when_one_rank_has_an_update_open():
    """In-place updates (update_staging='off'): a rank with an update open refuses to resume,
    and then no rank resumes."""
    async def main():
        engine = dp_engine(2, update_staging="off")
        dp = engine.core
        try:
            await engine.pause_generation(mode="keep")
            await asyncio.to_thread(trainer_sender, engine, load_model("tiny", seed=2))
            await asyncio.wrap_future(dp.rank_call(0, "start_weight_update"))
            with pytest.raises(LifecycleError,
                               match="rank 0: LifecycleError: a weight update is open"):
                await engine.resume_generation()
            assert all(r["global_paused"] for r in await rank_stats(engine))
            with pytest.raises(PeerError, match="sender aborted"):
                await asyncio.wrap_future(dp.rank_call(0, "update_weights", {"abort": "test"}))
            await engine.resume_generation()
            assert not any(r["paused"] for r in await rank_stats(engine))
            out = await collect(engine, "q", [4, 2], GREEDY)
            assert out.outputs[0].finish_reason == "length"
        finally:
            engine.shutdown()

    run(main())


def test_a_dead_rank_ends_its_requests_with_an_error_and_later_calls_fail_fast():
    async def main():
        engine = dp_engine(2, step_timeout_s=10.0)
        try:
            progress = {}
            params = SamplingParams(max_tokens=1500, temperature=0.0)
            tasks = [asyncio.create_task(collect(engine, f"r{i}", [i + 1], params, progress))
                     for i in range(4)]
            await until(lambda: len(progress) == 4, "every request to run")
            os.kill(engine.core._procs[1].pid, signal.SIGKILL)
            outs = await asyncio.wait_for(asyncio.gather(*tasks), 30)
            assert {o.outputs[0].finish_reason for o in outs} == {"error"}
            assert all("rank 1" in o.outputs[0].error for o in outs)
            assert "rank 1" in engine.core.failure()
            with pytest.raises(EngineDeadError, match="rank 1"):
                await engine.stats()
        finally:
            engine.shutdown()

    run(main())


def backend_init_info(backend):
    """Trainer init info for `backend`; the trainer sizes itself by the engine's num_workers
    (nccl: world_size = 1 trainer + 2 ranks, rank r receiving as group rank 1 + r; ucx: two
    endpoints connect to the trainer)."""
    if backend == "nccl":
        import wtransfer_nccl

        return wtransfer_nccl.NCCLTrainerInitInfo(master_address="127.0.0.1",
                                                  world_size=3, bucket_bytes=1 << 16,
                                                  timeout_s=30)
    import wtransfer_ucx

    return wtransfer_ucx.UCXTrainerInitInfo(bucket_bytes=1 << 16, timeout_s=30)


@pytest.mark.parametrize("backend", ["nccl", "ucx"])
def test_every_rank_receives_over_nccl_and_ucx(backend):
    if not wtransfer.list_backends()[backend].available:
        pytest.skip(wtransfer.list_backends()[backend].reason)

    async def main():
        engine = dp_engine(2, weight_transfer_backend=backend)
        trainer = load_model("tiny", seed=5)
        try:
            await engine.pause_generation(mode="keep")
            info = backend_init_info(backend)

            def push():
                with wtransfer.trainer_init(info, client=LocalEngineClient(engine),
                                            source=wtransfer.ModuleSource(trainer)) as sender:
                    sender.send_weights(weight_version=f"{backend}-1")
                    with torch.no_grad():
                        next(trainer.parameters()).add_(1.0)
                    sender.send_weights(weight_version=f"{backend}-2")

            await asyncio.to_thread(push)
            assert await engine.fingerprint() == wtransfer.fingerprint(trainer.state_dict())
            assert await engine.get_weight_version() == f"{backend}-2"
            await engine.resume_generation()
            out = await collect(engine, "q", [1, 2, 3], GREEDY)
            assert out.outputs[0].weight_versions == [WeightVersionSpan(f"{backend}-2", 0, 24)]
        finally:
            engine.shutdown()

    run(main())


def test_a_rank_that_cannot_start_says_why():
    bad_model = r"rank \d: ConfigError: unknown model .no-such-model."
    with pytest.raises(wtransfer.errors.ConfigError, match=bad_model):
        AsyncEngine(EngineConfig(model="no-such-model", data_parallel_size=2))


@pytest.mark.gpu
def test_two_ranks_on_one_gpu_receive_cuda_weights_over_cuda_ipc():
    """device="cuda": rank r on GPU r modulo the GPUs present (both on cuda:0 with one GPU);
    the trainer's CUDA tensors reach each rank through CUDA IPC handles (the all-reduce stays
    on gloo)."""

    async def main():
        engine = dp_engine(2, device="cuda")
        trainer = load_model("tiny", seed=6, device="cuda:0")
        try:
            progress = {}
            params = SamplingParams(max_tokens=40, temperature=0.0)
            tasks = [asyncio.create_task(collect(engine, f"g{i}", [i + 1, 2], params, progress))
                     for i in range(4)]
            await until(lambda: len(progress) == 4 and min(progress.values()) >= 2,
                        "every request to run")
            await engine.pause_generation(mode="keep", clear_cache=True)

            def push():
                with trainer_sender(engine, trainer) as sender:
                    sender.send_weights(weight_version="gpu-1")

            await asyncio.to_thread(push)
            assert await engine.fingerprint() == wtransfer.fingerprint(trainer.state_dict())
            gpus = torch.cuda.device_count()
            assert [r["device"] for r in await rank_stats(engine)] == \
                [f"cuda:{r % gpus}" for r in range(2)]
            await engine.resume_generation()
            for out in await asyncio.wait_for(asyncio.gather(*tasks), 60):
                assert [s.version for s in out.outputs[0].weight_versions] == ["default",
                                                                              "gpu-1"]
        finally:
            engine.shutdown()

    run(main())


def test_a_rollback_one_rank_cannot_do_leaves_every_rank_as_it_was():
    """Two staged (swap) ranks: a rollback brings the previous version back on both; one that
    rank 1 cannot do (its previous version gone, as an update start that reached only it
    leaves it) is refused naming rank 1 and why, and no rank rolled back: both still hold
    the last update, with its label, and serve it."""
    async def main():
        engine = dp_engine(2, update_staging="swap")
        first, second = load_model("tiny", seed=1), load_model("tiny", seed=2)

        def push(model, version):
            with trainer_sender(engine, model) as sender:
                sender.send_weights(weight_version=version)

        try:
            original = await engine.fingerprint()
            with pytest.raises(wtransfer.errors.ConfigError, match="data-parallel rank's step"):
                engine.core.submit("reserve_rollback").result(10)
            await asyncio.to_thread(push, first, "v1")
            await engine.rollback_weights()
            assert await engine.fingerprint() == original  # (the ranks agree, or it raises)
            assert await engine.get_weight_version() == "default"
            await asyncio.to_thread(push, first, "v1")
            await asyncio.to_thread(push, second, "v2")
            await asyncio.wrap_future(engine.core.rank_call(1, "start_weight_update"))
            await asyncio.wrap_future(engine.core.rank_call(1, "discard_weight_update", "test"))
            with pytest.raises(LifecycleError, match=r"no rank rolled back: data-parallel rank "
                                                     r"1: .*no previous weight version"):
                await engine.rollback_weights()
            assert await engine.fingerprint() == wtransfer.fingerprint(second.state_dict())
            assert await engine.get_weight_version() == "v2"
            out = await collect(engine, "after", [1, 2, 3], GREEDY)
            assert [s.version for s in out.outputs[0].weight_versions] == ["v2"]
        finally:
            engine.shutdown()

    run(main(), deadline_s=180)
