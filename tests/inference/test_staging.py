"""Staged updates: the engine keeps generating while an update lands in its shadow; the commit
at a step boundary makes it live, and a swap back rolls it back.

Every case drives real engines through the real control plane (an ipc or nccl trainer over
`wtransfer.rpc`), with greedy batch-invariant requests streaming and no pause call, and checks
what a user sees: tokens that kept coming while the update was open, weight-version spans split
exactly once, tails equal to a fresh engine holding the new weights, fingerprints.
"""

import asyncio
import os
import signal
import threading
import time

import pytest
from engine_helpers import collect, run, until
from wtransfer_ipc import IPCTrainerInitInfo
from wtransfer_nccl import NCCLTrainerInitInfo

import wtransfer
from wtransfer.errors import ConfigError, LifecycleError
from wtransfer.inference import (
    AsyncEngine,
    EngineConfig,
    LocalEngineClient,
    SamplingParams,
    WeightVersionSpan,
)
from wtransfer.inference.model.decoder import load_model
from wtransfer.launch.processes import spawn_trainer
from wtransfer.testing.conformance import wait_for

MAX = 120


class SlowSource(wtransfer.ModuleSource):
    """Yields the model's tensors with a pause after each, so an update stays open for a while
    (a trainer gathering its shards, say); records the engine's token count when the first
    and the last tensor were read."""

    def __init__(self, model, engine_tokens, delay_s=0.01):
        super().__init__(model)
        self.engine_tokens, self.delay_s, self.seen = engine_tokens, delay_s, []

    def held(self):
        return None  # (no tensors read in place: every one comes through `tensors`, slowly)

    def tensors(self):
        self.seen.append(self.engine_tokens())
        for item in super().tensors():
            yield item
            time.sleep(self.delay_s)
        self.seen.append(self.engine_tokens())


def trainer_info(backend, **fields):
    if backend == "nccl":
        return NCCLTrainerInitInfo(master_address="127.0.0.1", world_size=1 + fields.pop(
            "workers", 1), timeout_s=60, bucket_bytes=1 << 16, **fields)
    return IPCTrainerInitInfo(bucket_bytes=1 << 16, timeout_s=60, **fields)


async def staged_update_while_streaming(engine, backend, workers=1, version="v1", seed=1):
    """Stream greedy requests, push `seed`'s weights staged (no pause) from a trainer thread
    over RPC, return the outputs, the trainer model, and the token counts the source saw."""
    prompts = {f"r{i}": [(7 * i + 5 * j) % 256 for j in range(3 + i % 4)]
               for i in range(2 * workers)}
    progress = {}
    greedy = SamplingParams(max_tokens=MAX, temperature=0.0)
    tasks = {rid: asyncio.create_task(collect(engine, rid, p, greedy, progress))
             for rid, p in prompts.items()}
    await until(lambda: len(progress) == len(prompts) and min(progress.values()) >= 3,
                "every request to start")
    trainer = load_model("tiny", seed=seed)
    source = SlowSource(trainer, lambda: sum(progress.values()))
    client = wtransfer.rpc.RPCClient(engine.serve_rpc(), timeout_s=60)

    def push():
        with wtransfer.trainer_init(trainer_info(backend, workers=workers) if backend == "nccl"
                                    else trainer_info(backend), client=client,
                                    source=source) as sender:
            sender.send_weights(weight_version=version)

    await asyncio.to_thread(push)
    outs = {rid: await task for rid, task in tasks.items()}
    client.close()
    return prompts, outs, trainer, source.seen


async def check_tails(prompts, outs, seed, version):
    """Every request's spans split once at the commit; its tail equals a fresh engine with
    the new weights fed the prompt and the tokens before the commit."""
    fresh = AsyncEngine(EngineConfig(model="tiny", seed=seed, batch_invariant=True))
    try:
        for rid, out in outs.items():
            done = out.outputs[0]
            assert done.finish_reason == "length" and len(done.token_ids) == MAX
            old, new = done.weight_versions
            k = old.end
            assert old == WeightVersionSpan("default", 0, k) and 3 <= k < MAX, (rid, k)
            assert new == WeightVersionSpan(version, k, MAX)
            tail = await collect(fresh, rid, prompts[rid] + done.token_ids[:k],
                                 SamplingParams(max_tokens=MAX - k, temperature=0.0))
            assert tail.outputs[0].token_ids == done.token_ids[k:], rid
    finally:
        fresh.shutdown()


@pytest.mark.parametrize("backend", ["ipc", "nccl"])
def test_a_staged_update_lands_while_requests_keep_generating(backend):
    """No pause: the engine kept producing tokens while the (slow) trainer's update was
    open, the update went live at one step boundary, and every token after it was computed
    with the new weights."""
    async def main():
        engine = AsyncEngine(EngineConfig(model="tiny", batch_invariant=True,
                                          update_staging="swap",
                                          weight_transfer_backend=backend))
        try:
            prompts, outs, trainer, seen = await staged_update_while_streaming(engine, backend)
            assert seen[1] - seen[0] >= 10, f"only {seen[1] - seen[0]} tokens while staging"
            assert await engine.fingerprint() == wtransfer.fingerprint(trainer.state_dict())
            info = await engine.weight_info()
            assert (info["weight_version"], info["update_staging"], info["torn"]) == (
                "v1", "swap", False)
            assert info["previous_version"] == "default" and info["update_stall_ms"] > 0
            assert not await engine.is_paused()
        finally:
            engine.shutdown()
        await check_tails(prompts, outs, seed=1, version="v1")

    run(main(), deadline_s=240)


def test_data_parallel_ranks_each_stage_and_commit():
    """DP=2, staged, no pause: both ranks keep generating, each commits its own shadow, and
    every rank holds the trainer's weights."""
    async def main():
        engine = AsyncEngine(EngineConfig(model="tiny", batch_invariant=True,
                                          data_parallel_size=2, dp_sync_interval=8,
                                          update_staging="swap", step_timeout_s=30.0))
        try:
            prompts, outs, trainer, seen = await staged_update_while_streaming(
                engine, "ipc", workers=2)
            assert seen[1] > seen[0]
            want = wtransfer.fingerprint(trainer.state_dict())
            for rank in range(2):
                assert await asyncio.wrap_future(
                    engine.core.rank_call(rank, "fingerprint")) == want, rank
        finally:
            engine.shutdown()
        await check_tails(prompts, outs, seed=1, version="v1")

    run(main(), deadline_s=240)


def test_a_trainer_killed_mid_stage_leaves_the_live_weights_and_the_next_update_lands():
    """SIGKILL the trainer while its staged update is open: the engine never stopped, its
    live weights and version are as before and not torn, and a new trainer's update lands."""
    async def main():
        engine = AsyncEngine(EngineConfig(model="tiny", update_staging="swap"))
        try:
            before = await engine.fingerprint()
            address = engine.serve_rpc()
            out = asyncio.create_task(collect(engine, "bg", [4, 2],
                                              SamplingParams(max_tokens=1500, temperature=0)))

            def kill_mid_stage():
                trainer = spawn_trainer("ipc", address, model="llm:tiny", seed=3, loop=True,
                                        vary=True, init_fields={"bucket_bytes": 4096,
                                                                "timeout_s": 1.0})
                try:
                    wait_for(lambda: (i := engine.call("weight_info"))["update_state"] ==
                             "updating" and i["update_bytes"] > 0, 60,
                             "a staged update past its first bucket", interval_s=0.001)
                    os.kill(trainer.proc.pid, signal.SIGKILL)
                finally:
                    trainer.kill()
                    trainer.close()
                return wait_for(lambda: (i := engine.call("weight_info"))["update_state"] ==
                                "failed" and i, 10, "the engine to fail the abandoned update")

            info = await asyncio.to_thread(kill_mid_stage)
            assert info["torn"] is False
            version = info["weight_version"]
            if version == "default":
                assert await engine.fingerprint() == before
            assert (await out).outputs[0].finish_reason == "length"  # it never stopped
            trainer = load_model("tiny", seed=9)
            client = LocalEngineClient(engine)
            with wtransfer.trainer_init(trainer_info("ipc"), client=client,
                                        source=wtransfer.ModuleSource(trainer)) as sender:
                await asyncio.to_thread(sender.send_weights, "after")
            assert await engine.fingerprint() == wtransfer.fingerprint(trainer.state_dict())
            assert await engine.get_weight_version() == "after"
        finally:
            engine.shutdown()

    run(main(), deadline_s=240)


def push(engine, model, version, **fields):
    """One staged update of `model` from this thread (in-process engine, over RPC)."""
    client = wtransfer.rpc.RPCClient(engine.serve_rpc(), timeout_s=60)
    try:
        with wtransfer.trainer_init(trainer_info("ipc", **fields), client=client,
                                    source=wtransfer.ModuleSource(model)) as sender:
            return sender.send_weights(weight_version=version)
    finally:
        client.close()


def test_rollback_swaps_the_previous_version_back_once():
    """After a staged swap commit, rollback_weights restores the previous fingerprint and
    label; once, and only until the next update starts; a subset update commits only its
    tensors, and its rollback restores exactly them."""
    async def main():
        engine = AsyncEngine(EngineConfig(model="tiny", update_staging="swap"))
        try:
            original = await engine.fingerprint()
            with pytest.raises(LifecycleError, match="no previous weight version"):
                await engine.rollback_weights()
            for step, args in (("reserve_rollback", ()), ("release_rollback", ()),
                               ("rollback_weights", (True,))):  # (a DP front end's steps)
                with pytest.raises(ConfigError, match="is a data-parallel rank's step"):
                    engine.core.submit(step, *args)
            first = load_model("tiny", seed=1)
            await asyncio.to_thread(push, engine, first, "v1")
            assert await engine.fingerprint() == wtransfer.fingerprint(first.state_dict())
            await engine.rollback_weights()
            assert await engine.fingerprint() == original
            assert await engine.get_weight_version() == "default"
            with pytest.raises(LifecycleError, match="no previous weight version"):
                await engine.rollback_weights()

            await asyncio.to_thread(push, engine, first, "v1")
            second = load_model("tiny", seed=2)
            names = [n for n in second.state_dict() if ".mlp." in n]
            client = wtransfer.rpc.RPCClient(engine.serve_rpc(), timeout_s=60)
            with wtransfer.trainer_init(trainer_info("ipc"), client=client,
                                        source=wtransfer.ModuleSource(second, names=names)) as s:
                await asyncio.to_thread(s.send_weights, "v2")
            now = await engine.fingerprint()
            want_first = wtransfer.fingerprint(first.state_dict())
            want_second = wtransfer.fingerprint(second.state_dict())
            assert {n: now[n] for n in names} == {n: want_second[n] for n in names}
            assert all(now[n] == want_first[n] for n in now if n not in names)
            await engine.rollback_weights()
            assert await engine.fingerprint() == want_first
            assert await engine.get_weight_version() == "v1"
        finally:
            engine.shutdown()

    run(main(), deadline_s=240)


def test_copy_staging_keeps_the_live_storages_and_refuses_rollback():
    """update_staging='copy' copies the shadow into the live parameters: their storage
    pointers never change (for kernels that captured them), and no previous version stays."""
    async def main():
        engine = AsyncEngine(EngineConfig(model="tiny", update_staging="copy"))
        try:
            model = engine.core.replica.model
            pointers = {n: p.data_ptr() for n, p in model.named_parameters()}
            trainer = load_model("tiny", seed=5)
            await asyncio.to_thread(push, engine, trainer, "c1")
            assert await engine.fingerprint() == wtransfer.fingerprint(trainer.state_dict())
            assert {n: p.data_ptr() for n, p in model.named_parameters()} == pointers
            with pytest.raises(LifecycleError, match="copy staging"):
                await engine.rollback_weights()
        finally:
            engine.shutdown()

    run(main())


def test_a_staging_mode_that_does_not_fit_is_refused_at_start_up(monkeypatch):
    """A shadow needs one more copy of the weights; a mode that cannot have it is refused
    when the engine starts, saying what to choose instead. (The host's free memory is the
    one thing set here: 1 KiB.)"""
    from wtransfer.inference.updates import replica

    monkeypatch.setattr(replica, "available_host_memory", lambda: 1 << 10)
    with pytest.raises(ConfigError, match=r"update_staging='swap' keeps one more copy.*"
                                          r"choose update_staging='off'"):
        AsyncEngine(EngineConfig(model="tiny", update_staging="swap"))
    auto = AsyncEngine(EngineConfig(model="tiny"))
    assert auto.call("weight_info")["update_staging"] == "off"  # auto: it does not fit
    auto.shutdown()


def test_tokens_keep_coming_from_the_engine_thread_while_a_call_is_on_the_lane():
    """While a staged update's call holds the transfer lane (its source stalls on purpose),
    the engine thread finishes whole requests."""
    async def main():
        engine = AsyncEngine(EngineConfig(model="tiny", update_staging="swap"))
        try:
            hold = threading.Event()

            class Stalled(wtransfer.ModuleSource):
                def tensors(self):
                    for i, item in enumerate(super().tensors()):
                        if i == 3:
                            assert hold.wait(60)
                        yield item

            client = wtransfer.rpc.RPCClient(engine.serve_rpc(), timeout_s=60)
            sender = wtransfer.trainer_init(trainer_info("ipc"), client=client,
                                            source=Stalled(load_model("tiny", seed=6)))
            sending = asyncio.create_task(asyncio.to_thread(sender.send_weights, "late"))
            await until(lambda: engine.call("weight_info")["update_state"] == "updating",
                        "the update to open")
            done = await collect(engine, "during", [9, 9, 9],
                                 SamplingParams(max_tokens=20, temperature=0))
            assert done.outputs[0].weight_versions == [WeightVersionSpan("default", 0, 20)]
            hold.set()
            await sending
            assert await engine.get_weight_version() == "late"
            sender.shutdown()
        finally:
            engine.shutdown()

    run(main())
