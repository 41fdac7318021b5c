"""Nothing non-finite goes live: an update holding NaN or infinity is refused before it is
served (staged: the shadow is dropped; in place: rolled back), and a request whose logits are
not finite ends alone with finish_reason "error", never a 500 or invalid JSON."""

import asyncio
import json

import pytest
from engine_helpers import collect, run
from test_http import KEY, Server
from wtransfer_ipc import IPCTrainerInitInfo

import wtransfer
from wtransfer.errors import NonFiniteError
from wtransfer.inference import AsyncEngine, EngineConfig, LocalEngineClient, SamplingParams
from wtransfer.inference.model.decoder import load_model

GREEDY = SamplingParams(max_tokens=12, temperature=0.0)
PROMPT = [5, 6, 7, 8]


def diverged(seed=3):
    """A trainer model with one NaN in a layer's weight and one infinity in a norm."""
    model = load_model("tiny", seed=seed)
    state = model.state_dict()
    state["model.layers.1.mlp.down_proj.weight"].view(-1)[7] = float("nan")
    state["model.norm.weight"].view(-1)[0] = float("inf")
    return model


@pytest.mark.parametrize("staging", ["swap", "copy", "off"])
def test_an_update_holding_nan_is_refused_and_nothing_changes(staging):
    """Staged or in place: the trainer gets `NonFiniteError` naming the tensor; the engine's
    fingerprint, version and greedy tokens are what they were; the next clean update lands."""
    async def main():
        engine = AsyncEngine(EngineConfig(model="tiny", batch_invariant=True,
                                          update_staging=staging))
        client = LocalEngineClient(engine)
        try:
            before = await engine.fingerprint()
            tokens = (await collect(engine, "a", PROMPT, GREEDY)).outputs[0].token_ids

            def push(model, version):
                with wtransfer.trainer_init(IPCTrainerInitInfo(bucket_bytes=1 << 16),
                                            client=client,
                                            source=wtransfer.ModuleSource(model)) as sender:
                    sender.send_weights(weight_version=version)

            with pytest.raises(NonFiniteError,
                               match=r"'model\.layers\.1\.mlp\.down_proj\.weight' holds NaN"):
                await asyncio.to_thread(push, diverged(), "bad")
            assert await engine.fingerprint() == before
            assert await engine.get_weight_version() == "default"
            info = await engine.weight_info()
            assert info["torn"] is False
            again = await collect(engine, "b", PROMPT, GREEDY)
            assert again.outputs[0].token_ids == tokens
            assert again.outputs[0].weight_versions[0].version == "default"
            clean = load_model("tiny", seed=3)
            await asyncio.to_thread(push, clean, "good")
            assert await engine.fingerprint() == wtransfer.fingerprint(clean.state_dict())
            assert await engine.get_weight_version() == "good"
        finally:
            engine.shutdown()

    run(main())


def test_non_finite_weights_allowed_on_purpose_end_requests_with_an_error_not_a_500():
    """A trainer that opts out (`allow_non_finite`) gets its NaN weights served; then every
    generate, plain or streamed, answers 200 with valid JSON and finish_reason "error"."""
    server = Server("--dev-mode", "--api-key", KEY)
    try:
        client = wtransfer.HTTPClient(server.url, api_key=KEY)
        with pytest.raises(NonFiniteError, match="allow_non_finite=True"), \
                wtransfer.trainer_init(IPCTrainerInitInfo(bucket_bytes=1 << 16), client=client,
                                       source=wtransfer.ModuleSource(diverged())) as sender:
            sender.send_weights(weight_version="bad")
        assert server.http.get("/weight_info").json()["weight_version"] == "default"
        model = diverged()
        with wtransfer.trainer_init(IPCTrainerInitInfo(bucket_bytes=1 << 16,
                                                       allow_non_finite=True),
                                    client=client, source=wtransfer.ModuleSource(model)) as s:
            s.send_weights(weight_version="meant")
        assert client.fingerprint() == wtransfer.fingerprint(model.state_dict())
        for temperature in (0.0, 1.0):
            body = {"token_ids": PROMPT,
                    "sampling_params": {"max_tokens": 4, "temperature": temperature}}
            reply = server.http.post("/inference/v1/generate", json=body)
            assert reply.status_code == 200, reply.text
            choice = json.loads(reply.text)["choices"][0]
            assert choice["finish_reason"] == "error"
            assert "not finite" in choice["error"]
            with server.http.stream("POST", "/inference/v1/generate",
                                    json={**body, "stream": True}) as r:
                events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]"
            final = json.loads(events[-2])  # strict JSON: no bare NaN
            assert final["choices"][0]["finish_reason"] == "error"
    finally:
        server.stop()


def test_a_request_with_non_finite_logits_fails_alone():
    """One sequence's logits turn NaN (its adapter, say): it ends with "error", and its
    batch-mates, sampled in the same steps at temperature 1, finish normally."""
    async def main():
        engine = AsyncEngine(EngineConfig(model="tiny"))
        runner = engine.core.replica.runner
        forward = runner._forward

        def poisoned(seqs):
            logits = forward(seqs)
            for row, seq in enumerate(seqs):
                if seq.request_id == "poisoned":
                    logits[row] = float("nan")
            return logits

        runner._forward = poisoned
        try:
            params = SamplingParams(max_tokens=6, temperature=1.0, seed=1)
            outs = await asyncio.gather(*(collect(engine, rid, PROMPT, params)
                                          for rid in ("a", "poisoned", "b")))
            a, bad, b = (o.outputs[0] for o in outs)
            assert bad.finish_reason == "error" and "not finite" in bad.error
            assert (a.finish_reason, b.finish_reason) == ("length", "length")
            assert len(a.token_ids) == len(b.token_ids) == 6
        finally:
            engine.shutdown()

    run(main())


def test_kv_left_behind_by_a_non_finite_version_never_reaches_later_requests():
    """Weights served on purpose with a NaN in a value projection leave NaN K/V in the blocks
    their requests held; after a clean update, requests of different lengths batched together
    get those blocks (stale tails and all) and must all finish normally: a key past a
    sequence's end is never read into its scores, even masked."""
    async def main():
        engine = AsyncEngine(EngineConfig(model="tiny", num_kv_blocks=8, block_size=16))
        client = LocalEngineClient(engine)
        try:
            poisoned = load_model("tiny", seed=3)
            poisoned.state_dict()["model.layers.0.self_attn.v_proj.weight"].view(-1)[:64] = (
                float("nan"))
            clean = load_model("tiny", seed=4)
            for model, allow in ((poisoned, True), (clean, False)):
                with wtransfer.trainer_init(IPCTrainerInitInfo(allow_non_finite=allow),
                                            client=client,
                                            source=wtransfer.ModuleSource(model)) as sender:
                    await asyncio.to_thread(sender.send_weights)
                if model is poisoned:  # fill every block with NaN K/V
                    outs = await asyncio.gather(*(collect(engine, f"p{i}", [i + 1] * 30, GREEDY)
                                                  for i in range(4)))
                    assert {o.outputs[0].finish_reason for o in outs} == {"error"}
            prompts = {f"c{i}": [(5 * i + j) % 256 for j in range(2 + 7 * i)] for i in range(4)}
            outs = await asyncio.gather(*(collect(engine, rid, p, GREEDY)
                                          for rid, p in prompts.items()))
            assert [o.outputs[0].finish_reason for o in outs] == ["length"] * 4, [
                o.outputs[0].error for o in outs]
        finally:
            engine.shutdown()
    run(main())


@pytest.mark.parametrize("rank", [0, 1])
def test_with_tensor_parallel_a_nan_in_one_workers_part_goes_live_on_no_worker(rank):
    """TP=2 in place: the NaN lies in what one worker keeps of a split tensor; every worker's
    part is checked before any goes live, so the other worker keeps its old part too."""
    async def main():
        engine = AsyncEngine(EngineConfig(model="tiny", tensor_parallel_size=2,
                                          update_staging="off", update_rollback=True))
        client = LocalEngineClient(engine)
        try:
            before = await engine.fingerprint()
            model = load_model("tiny", seed=3)
            down = model.state_dict()["model.layers.1.mlp.down_proj.weight"]  # split by column
            down[0, 0 if rank == 0 else -1] = float("nan")
            with pytest.raises(NonFiniteError, match=r"down_proj\.weight' holds NaN"), \
                    wtransfer.trainer_init(IPCTrainerInitInfo(bucket_bytes=1 << 16),
                                           client=client,
                                           source=wtransfer.ModuleSource(model)) as sender:
                await asyncio.to_thread(sender.send_weights, weight_version="bad")
            assert await engine.fingerprint() == before
            info = await engine.weight_info()
            assert info["weight_version"] == "default" and info["torn"] is False
            assert [(w["update_state"], w["torn"]) for w in info["workers"]] == \
                [("failed", False)] * 2
        finally:
            engine.shutdown()

    run(main())
