"""SDPA's cuDNN kernel builds a plan for every new shape (67-131 ms each on an H100), and a
serving step's prefill shapes are new nearly every time: the model's forward keeps SDPA off
it on CUDA (`attention.without_cudnn_attention`), and gives the process's setting back."""

import threading

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from wtransfer.inference.model.attention import without_cudnn_attention
from wtransfer.inference.model.decoder import load_model

CUDA = torch.device("cuda")


@pytest.fixture
def cudnn_on():
    """cuDNN attention allowed, as a process starts (and put back as it was after)."""
    was = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(True)
    yield
    torch.backends.cuda.enable_cudnn_sdp(was)


def test_forwards_of_several_threads_keep_cudnn_off_until_the_last_leaves(cudnn_on):
    """The switch is the process's: it stays off while any forward is inside, whichever
    thread entered first or leaves last, and is on again once none is."""
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def first():
        with without_cudnn_attention(CUDA):
            first_in.set()
            second_in.wait(10)
        first_out.set()

    def second():
        first_in.wait(10)
        with without_cudnn_attention(CUDA):
            second_in.set()
            first_out.wait(10)
            seen["after the first left"] = torch.backends.cuda.cudnn_sdp_enabled()

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert seen == {"after the first left": False}
    assert torch.backends.cuda.cudnn_sdp_enabled()


def test_a_process_that_turned_cudnn_off_keeps_it_off(cudnn_on):
    torch.backends.cuda.enable_cudnn_sdp(False)
    with without_cudnn_attention(CUDA):
        pass
    assert not torch.backends.cuda.cudnn_sdp_enabled()


def test_on_the_host_nothing_is_switched(cudnn_on):
    with without_cudnn_attention(torch.device("cpu")):
        assert torch.backends.cuda.cudnn_sdp_enabled()


def sdpa_ops(run):
    """The names of the ops `run()` dispatched."""
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    return {event.name for event in prof.events()}


@pytest.mark.gpu
def test_prefill_attention_never_runs_cudnn_where_sdpa_would_choose_it(cudnn_on):
    """A bf16 Qwen3-0.6B prefill of three prompts: SDPA alone chooses cuDNN for its layout
    (else the test says so and skips), the model's forward never does."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    model = load_model("qwen3-0.6b", device="cuda")  # (bfloat16, head_dim 128)
    q = torch.randn(3, 8, 2 * 70, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(3, 8, 70, 128, device="cuda", dtype=torch.bfloat16)
    mask = torch.ones(3, 1, 2 * 70, 70, device="cuda", dtype=torch.bool).tril()
    alone = sdpa_ops(lambda: F.scaled_dot_product_attention(q, k, k, attn_mask=mask))
    if not [name for name in alone if "cudnn_attention" in name]:
        pytest.skip(f"SDPA does not choose cuDNN here (torch {torch.__version__})")
    prompts = [[(7 * i + j) % 1000 for j in range(n)] for i, n in enumerate((5, 33, 70))]
    logits = []
    names = sdpa_ops(lambda: logits.extend(model.sequence_logits(prompts)))
    assert any("scaled_dot_product" in name for name in names), sorted(names)[:20]
    assert not [name for name in names if "cudnn_attention" in name]
    assert all(torch.isfinite(x).all() for x in logits)
    assert torch.backends.cuda.cudnn_sdp_enabled()  # (given back)
