"""Nothing a client sends can wedge the engine: admission checks every sampling field, a
failing step ends only its own requests, a dead engine says so at once, and a duplicate
request id never touches the request already running under it."""

import asyncio
import os
import sys
import textwrap

import httpx
import pytest
from engine_helpers import GREEDY, collect, run, until
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from wtransfer.errors import ConfigError, EngineDeadError
from wtransfer.inference import AsyncEngine, EngineConfig, SamplingParams
from wtransfer.inference.serving.server import build_app

POISON = 251
"""A prompt holding this token makes the injected fault fire in the step that computes it."""


def poison_runner(runner):
    """Make `runner.run` raise for any batch holding a poisoned sequence (the fault)."""
    real = runner.run

    def run_batch(seqs):
        if any(POISON in s.prompt for s in seqs):
            raise RuntimeError("injected fault: CUDA error: an illegal memory access")
        return real(seqs)

    runner.run = run_batch


def test_a_failing_step_ends_only_its_requests_and_the_engine_keeps_serving():
    async def main():
        engine = AsyncEngine(EngineConfig(model="tiny", batch_invariant=True))
        try:
            poison_runner(engine.core.replica.runner)
            long = SamplingParams(max_tokens=300, temperature=0.0)
            progress = {}
            healthy = asyncio.create_task(collect(engine, "healthy", [1, 2, 3], long, progress))
            await until(lambda: progress.get("healthy", 0) >= 5, "the healthy request to run")
            bad = await collect(engine, "bad", [4, POISON, 6], GREEDY)
            assert bad.outputs[0].finish_reason == "error"
            assert "illegal memory access" in bad.outputs[0].error
            done = await healthy
            # the healthy request may share the failing step (it ends with it) or not; either
            # way it ends, and a new request afterwards is served in full
            assert done.outputs[0].finish_reason in ("length", "error")
            after = await collect(engine, "after", [7, 8], GREEDY)
            assert after.outputs[0].finish_reason == "length"
            assert len(after.outputs[0].token_ids) == GREEDY.max_tokens
            assert engine.failure() is None
        finally:
            engine.shutdown()

    run(main())


def test_a_dead_engine_loop_fails_every_call_at_once_and_health_says_503():
    async def main():
        engine = AsyncEngine(EngineConfig(model="tiny"))
        app = build_app(engine, dev_mode=True)
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://e")
        try:
            assert (await http.get("/health")).json() == {"status": "ok"}
            progress = {}
            live = asyncio.create_task(collect(engine, "live", [1, 2],
                                               SamplingParams(max_tokens=500), progress))
            await until(lambda: progress.get("live", 0) >= 2, "the request to run")

            def broken_schedule():
                raise MemoryError("injected: the scheduler's state is gone")

            engine.core.replica.scheduler.schedule = broken_schedule
            out = await asyncio.wait_for(live, 30)
            assert out.outputs[0].finish_reason == "error"
            assert "scheduler's state is gone" in out.outputs[0].error
            assert "MemoryError" in engine.failure()
            with pytest.raises(EngineDeadError, match="the engine stopped"):
                await collect(engine, "later", [3], GREEDY)
            health = await http.get("/health")
            assert health.status_code == 503 and health.json()["status"] == "dead"
            refused = await http.post("/inference/v1/generate", json={"token_ids": [1]})
            assert refused.status_code == 503 and refused.json()["error"] == "EngineDeadError"
            assert (await http.post("/pause")).status_code == 503
        finally:
            await http.aclose()
            engine.shutdown()

    run(main())


def test_a_failing_step_on_one_data_parallel_rank_ends_only_its_requests(tmp_path,
                                                                          monkeypatch):
    # the fault is injected in the rank processes themselves, at interpreter start-up
    (tmp_path / "sitecustomize.py").write_text(textwrap.dedent(f"""
        from wtransfer.inference.steps import runner
        real = runner.ModelRunner.run
        def run(self, seqs):
            if any({POISON} in s.prompt for s in seqs):
                raise RuntimeError("injected fault in a rank")
            return real(self, seqs)
        runner.ModelRunner.run = run
    """))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), *sys.path]))

    async def main():
        engine = AsyncEngine(EngineConfig(model="tiny", data_parallel_size=2,
                                          batch_invariant=True, dp_sync_interval=4))
        try:
            outs = await asyncio.gather(
                collect(engine, "bad", [POISON, 1], GREEDY),
                *[collect(engine, f"ok{i}", [i + 1, 2], GREEDY) for i in range(3)])
            assert outs[0].outputs[0].finish_reason == "error"
            assert "injected fault in a rank" in outs[0].outputs[0].error
            again = await collect(engine, "again", [9, 9], GREEDY)
            assert again.outputs[0].finish_reason == "length"
            assert engine.failure() is None
        finally:
            engine.shutdown()

    run(main())


def test_a_duplicate_request_id_is_refused_and_the_running_request_completes():
    async def main():
        engine = AsyncEngine(EngineConfig(model="tiny"))
        try:
            long = SamplingParams(max_tokens=200, temperature=0.0)
            progress = {}
            first = asyncio.create_task(collect(engine, "dup", [1, 2], long, progress))
            await until(lambda: progress.get("dup", 0) >= 3, "the first request to run")
            with pytest.raises(ConfigError, match="already running"):
                await collect(engine, "dup", [5, 6], GREEDY)
            out = await asyncio.wait_for(first, 60)
            assert out.outputs[0].finish_reason == "length"
            assert len(out.outputs[0].token_ids) == 200
        finally:
            engine.shutdown()

    run(main())


@pytest.mark.parametrize(("params", "field"), [
    ({"seed": 2**64}, "seed"), ({"seed": -(2**63) - 1}, "seed"),
    ({"temperature": 1e-46}, "temperature"), ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"max_tokens": 0}, "max_tokens"),
    ({"top_k": -1}, "top_k"), ({"stop_token_ids": [-1]}, "stop_token_ids"),
])
def test_out_of_range_sampling_fields_are_refused_naming_the_field(params, field):
    with pytest.raises(ConfigError, match=f"sampling_params.{field}"):
        SamplingParams(**params)


def test_extreme_but_valid_sampling_values_generate():
    async def main():
        engine = AsyncEngine(EngineConfig(model="tiny"))
        try:
            for params in (SamplingParams(top_p=1e-46, max_tokens=8),
                           SamplingParams(temperature=1e-5, max_tokens=8),
                           SamplingParams(seed=2**64 - 1, max_tokens=8),
                           SamplingParams(seed=-(2**63), top_k=1, max_tokens=8)):
                out = await collect(engine, None, [3, 4], params)
                assert out.outputs[0].finish_reason == "length"
        finally:
            engine.shutdown()

    run(main())


_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                max_size=3),
    max_leaves=12)
_sampling = st.fixed_dictionaries({}, optional={
    "max_tokens": st.integers(-5, 3000) | _json, "temperature": st.floats(-1, 1e40) | _json,
    "top_p": st.floats(-1, 2) | _json, "top_k": st.integers(-3, 10**6) | _json,
    "seed": st.integers(-(2**66), 2**66) | _json,
    "stop_token_ids": st.lists(st.integers(-3, 300), max_size=4) | _json,
    "bogus": _json})
_bodies = st.fixed_dictionaries({}, optional={
    "token_ids": st.lists(st.integers(-3, 300), max_size=6) | _json,
    "sampling_params": _sampling | _json, "request_id": st.text(max_size=8) | _json,
    "stream": st.booleans() | _json, "extra": _json}) | _json


@pytest.fixture(scope="module")
def fuzz_app():
    engine = AsyncEngine(EngineConfig(model="tiny", max_num_batched_tokens=4096))
    yield engine, build_app(engine, dev_mode=True)
    engine.shutdown()


@settings(max_examples=80, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=_bodies)
def test_no_generate_body_gets_a_5xx_and_the_engine_survives_each(fuzz_app, body):
    engine, app = fuzz_app

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://e", timeout=60) as http:
            reply = await http.post("/inference/v1/generate", json=body)
            assert reply.status_code < 500, (body, reply.text)
            assert reply.headers["content-type"].startswith(("application/json",
                                                             "text/event-stream"))
            if reply.status_code >= 400:
                assert set(reply.json()) == {"error", "message"}
            alive = await http.post("/inference/v1/generate", json={
                "token_ids": [1], "sampling_params": {"max_tokens": 2}})
            assert alive.status_code == 200, alive.text

    run(main())
    assert engine.failure() is None
