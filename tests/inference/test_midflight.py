"""The acceptance test: weights pushed mid-flight from another process, checked token by token.

Greedy requests run in batch-invariant mode; after a few tokens the engine pauses with keep +
clear_cache, a trainer process pushes new weights through ipc (RPCClient -> serve_rpc), and
the engine resumes. Every request's post-pause tokens must equal what a fresh engine holding
only the new weights generates from prompt + pre-pause tokens, and its weight_versions must be
exactly two spans split at the pause.
"""

import asyncio

from engine_helpers import collect

from wtransfer.inference import AsyncEngine, EngineConfig, SamplingParams, WeightVersionSpan
from wtransfer.launch.processes import spawn_trainer

MAX = 32


def test_midflight_keep_update_matches_a_fresh_engine_with_the_new_weights():
    async def main():
        loop = asyncio.get_running_loop()
        engine = AsyncEngine(EngineConfig(model="tiny", seed=0, batch_invariant=True))
        address = engine.serve_rpc()
        greedy = SamplingParams(max_tokens=MAX, temperature=0.0)
        prompts = {f"r{i}": [(11 * i + 3 * j) % 256 for j in range(4 + i)] for i in range(8)}
        progress = {}
        tasks = {rid: asyncio.create_task(collect(engine, rid, p, greedy, progress))
                 for rid, p in prompts.items()}
        while len(progress) < len(prompts) or min(progress.values()) < 4:
            await asyncio.sleep(0.001)
        await engine.pause_generation(mode="keep", clear_cache=True)

        def push_from_another_process():
            with spawn_trainer("ipc", address, model="llm:tiny", seed=1,
                               init_fields={"bucket_bytes": 1 << 16}) as trainer:
                assert trainer.info["event"] == "sending"
                assert trainer.read_line(120) == {"event": "done", "updates": 1}

        await loop.run_in_executor(None, push_from_another_process)
        assert await engine.get_weight_version() == "trainer-0"
        await engine.resume_generation()
        outs = {rid: await task for rid, task in tasks.items()}
        served = await engine.fingerprint()
        engine.shutdown()

        fresh = AsyncEngine(EngineConfig(model="tiny", seed=1, batch_invariant=True))
        assert await fresh.fingerprint() == served
        for rid, out in outs.items():
            done = out.outputs[0]
            assert done.finish_reason == "length" and len(done.token_ids) == MAX
            (old, new) = done.weight_versions
            pre = old.end
            assert old == WeightVersionSpan("default", 0, pre) and pre >= 4
            assert new == WeightVersionSpan("trainer-0", pre, MAX)
            reference = await collect(fresh, rid, prompts[rid] + done.token_ids[:pre],
                                      SamplingParams(max_tokens=MAX - pre, temperature=0.0))
            assert reference.outputs[0].token_ids == done.token_ids[pre:], rid
        fresh.shutdown()

    asyncio.run(asyncio.wait_for(main(), 240))
