"""Prefill/decode disaggregation with real servers: a prefill instance hands prompts' K/V over
to a decode instance, which decodes from it only under the same weight version. Greedy,
batch-invariant: P/D tokens equal a monolithic engine's."""

import os
import signal
import threading

import httpx
import pytest
from test_http import KEY, Server
from wtransfer_ipc import IPCTrainerInitInfo
from wtransfer_nccl import NCCLTrainerInitInfo

import wtransfer
from wtransfer.errors import MetadataError
from wtransfer.inference.model.decoder import load_model
from wtransfer.testing.conformance import wait_for

LONG = 1500
"""Tokens of a request that outlasts a fleet update."""
PROMPT = [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]


def pair(backend="ipc"):
    flags = ("--dev-mode", "--batch-invariant", "--weight-transfer-backend", backend,
             "--api-key", KEY)
    prefill = Server(*flags, "--role", "prefill")
    decode = Server(*flags, "--role", "decode", "--prefill-url", prefill.url,
                    "--prefill-api-key", KEY)
    return prefill, decode


def generate(server, max_tokens=10, prompt=PROMPT):
    reply = server.http.post("/inference/v1/generate", json={
        "token_ids": prompt, "sampling_params": {"max_tokens": max_tokens, "temperature": 0}})
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]


def metric(server, name):
    for line in server.http.get("/metrics").text.splitlines():
        if line.startswith(f"wtransfer_{name} "):
            return float(line.split()[1])
    raise AssertionError(f"no metric {name}")


def push(server, model, version, backend="ipc"):
    info = (NCCLTrainerInitInfo(master_address="127.0.0.1", bucket_bytes=1 << 14)
            if backend == "nccl" else IPCTrainerInitInfo(bucket_bytes=1 << 14))
    client = (server if isinstance(server, wtransfer.FanoutClient)
              else wtransfer.HTTPClient(server.url, api_key=KEY))
    with wtransfer.trainer_init(info, client=client,
                                source=wtransfer.ModuleSource(model)) as sender:
        sender.send_weights(weight_version=version)


@pytest.mark.parametrize("backend", ["ipc", pytest.param("nccl", marks=pytest.mark.extended)])
# (nccl: the same hand-over through another backend's receive path, `make test-extended`)
def test_remote_prefill_gives_the_monolithic_tokens_and_moves_the_prompt_kv(backend):
    mono = Server("--batch-invariant")
    prefill, decode = pair(backend)
    try:
        want = generate(mono)
        got = generate(decode)
        assert got["prefilled_by"] == "remote" and want["prefilled_by"] == "local"
        assert got["token_ids"] == want["token_ids"]
        assert got["weight_versions"] == want["weight_versions"]
        moved = metric(decode, "kv_bytes_received_total")
        layers, kv_heads, head_dim, item = 2, 2, 16, 4  # the tiny model, float32
        assert moved == 2 * layers * len(PROMPT) * kv_heads * head_dim * item
        assert metric(prefill, "kv_bytes_sent_total") == moved
        assert metric(decode, "prefilled_remote_total") == 1
    finally:
        for server in (mono, prefill, decode):
            server.stop()


def test_versions_never_mix_and_a_fleet_update_moves_both():
    """The prefill instance updated alone: the decode instance prefills locally and its
    tokens and spans are its own version's; once a fleet update moved both, remote again
    with the new weights' tokens; a request streaming through the decode instance during the
    fleet update splits its spans once."""
    prefill, decode = pair()
    mono = Server("--dev-mode", "--batch-invariant")
    try:
        before = generate(decode)
        new = load_model("tiny", seed=21)
        push(prefill, new, "v1")
        alone = generate(decode)
        assert alone["prefilled_by"] == "local"
        assert alone["token_ids"] == before["token_ids"]
        assert alone["weight_versions"] == [{"version": "default", "start": 0, "end": 10}]
        result = {}
        thread = threading.Thread(target=lambda: result.update(
            out=generate(decode, max_tokens=LONG, prompt=[9, 9, 9])))
        thread.start()
        wait_for(lambda: metric(decode, "running_requests") == 1, 60, "the request to run")
        fleet = wtransfer.FanoutClient([wtransfer.HTTPClient(s.url, api_key=KEY)
                                        for s in (prefill, decode)])
        push(fleet, new, "v2")
        thread.join(120)
        spans = result["out"]["weight_versions"]
        assert [s["version"] for s in spans] == ["default", "v2"], spans
        assert spans[0]["end"] == spans[1]["start"] and spans[1]["end"] == LONG
        push(mono, new, "v2")
        after = generate(decode)
        assert after["prefilled_by"] == "remote"
        assert after["token_ids"] == generate(mono)["token_ids"] != before["token_ids"]
        assert after["weight_versions"] == [{"version": "v2", "start": 0, "end": 10}]
    finally:
        for server in (prefill, decode, mono):
            server.stop()


def test_a_dead_prefill_instance_costs_a_local_prefill_not_the_request():
    prefill, decode = pair()
    try:
        remote = generate(decode)
        os.kill(prefill.proc.pid, signal.SIGKILL)
        prefill.proc.wait(30)
        local = generate(decode)
        assert local["prefilled_by"] == "local" and local["token_ids"] == remote["token_ids"]
        assert metric(decode, "remote_prefill_failures_total") == 1
    finally:
        prefill.stop()
        decode.stop()


def test_a_malformed_or_unauthenticated_kv_hand_over_is_refused():
    """The hand-over routes check the K/V against the engine (names, shapes, dtype, every
    layer) before any byte lands, and ask for the decode instance's API key."""
    import torch

    from wtransfer.inference.serving.handover import KVSource

    prefill, decode = pair()
    try:
        assert httpx.post(decode.url + "/kv/start_weight_update").status_code == 401
        client = wtransfer.HTTPClient(decode.url + "/kv", api_key=KEY)
        wrong = KVSource("r1", [(torch.zeros(4, 2, 8), torch.zeros(4, 2, 8))] * 2)
        with pytest.raises(MetadataError, match=r"KV hand-over refused: 'kv/r1/0\.k': "
                                                r"float32\[4, 2, 8\], expected float32"):
            push_kv(client, wrong)
        missing = KVSource("r2", [(torch.zeros(4, 2, 16), torch.zeros(4, 2, 16))])
        with pytest.raises(MetadataError, match=r"request 'r2': 2 of the 4 K/V tensors"):
            push_kv(client, missing)
        assert generate(decode)["prefilled_by"] == "remote"  # the channel still works
    finally:
        prefill.stop()
        decode.stop()


def push_kv(client, source):
    with wtransfer.trainer_init(IPCTrainerInitInfo(bucket_bytes=1 << 14), client=client,
                                source=source) as sender:
        sender.send_weights(weight_version="default")
