"""Decode attention that reads the paged KV cache in place (a Triton kernel used on CUDA,
`wtransfer.inference.model.paged_decode`): its output is SDPA's over the gathered keys, it
never reads past a sequence's length (a NaN left in a freed block does not leak in), and an
engine decoding through it gives the tokens of one that gathers its keys."""

import pytest
import torch
import torch.nn.functional as F
from engine_helpers import collect, run, tokens_of, triton_kernels

from wtransfer.inference import AsyncEngine, EngineConfig, SamplingParams
from wtransfer.inference.model import layer_kernels
from wtransfer.inference.model.attention import AttentionBatch, attend

pytestmark = pytest.mark.gpu
BLOCK = 16


@pytest.fixture(scope="module")
def kernel():
    return triton_kernels("paged_decode").paged_decode


def reference(q, k_cache, v_cache, tables, lengths):
    """SDPA in float32 over each sequence's gathered keys."""
    heads, kv_heads = q.shape[1], k_cache.shape[1]
    out = []
    for b in range(q.shape[0]):
        t = torch.arange(int(lengths[b]), device=q.device)
        slots = tables[b][t // BLOCK] * BLOCK + t % BLOCK
        k, v = (c[slots].float().transpose(0, 1) for c in (k_cache, v_cache))
        query = q[b].float().view(kv_heads, heads // kv_heads, -1)
        out.append(F.scaled_dot_product_attention(query, k, v).reshape(heads, -1))
    return torch.stack(out)


def cache_and_tables(kv_heads, dim, dtype, lengths, *, stale=0.0):
    """A cache of 64 blocks (each value `stale` past every sequence's length) and each
    sequence's blocks, taken in a shuffled order."""
    gen = torch.Generator().manual_seed(0)
    caches = [torch.full((64 * BLOCK, kv_heads, dim), stale, dtype=dtype) for _ in range(2)]
    order = torch.randperm(64, generator=gen)
    width = max(-(-n // BLOCK) for n in lengths)
    tables = torch.zeros(len(lengths), width + 2, dtype=torch.long)
    used = 0
    for b, n in enumerate(lengths):
        blocks = -(-n // BLOCK)
        tables[b, :blocks] = order[used : used + blocks]
        used += blocks
        t = torch.arange(n)
        slots = tables[b][t // BLOCK] * BLOCK + t % BLOCK
        for cache in caches:
            cache[slots] = torch.randn(n, kv_heads, dim, generator=gen).to(dtype)
    return [c.cuda() for c in caches], tables.cuda(), torch.tensor(lengths).cuda()


def queries(n, heads, dim, dtype):
    return torch.randn(n, heads, dim, generator=torch.Generator().manual_seed(1)).to(dtype).cuda()


@pytest.mark.parametrize("dtype,heads,kv_heads,dim,tolerance", [
    (torch.bfloat16, 16, 8, 128, 2e-2),   # Qwen3-0.6B's heads
    (torch.bfloat16, 32, 8, 128, 2e-2),   # Qwen3-8B's
    (torch.float16, 8, 8, 64, 2e-3),
    (torch.float32, 4, 2, 16, 1e-5),      # the tiny test model's
])
def test_the_kernel_gives_sdpa_over_the_gathered_keys(kernel, dtype, heads, kv_heads, dim,
                                                      tolerance):
    lengths = [1, 15, 16, 17, 64, 65, 300]
    (k_cache, v_cache), tables, ends = cache_and_tables(kv_heads, dim, dtype, lengths)
    q = queries(len(lengths), heads, dim, dtype)
    out = kernel(q, k_cache, v_cache, tables, ends, BLOCK)
    assert out.dtype == dtype and out.shape == q.shape
    want = reference(q, k_cache, v_cache, tables, ends)
    assert (out.float() - want).abs().max().item() < tolerance


def test_the_kernel_never_reads_past_a_sequences_length(kernel):
    lengths = [3, 16, 40]
    (k_cache, v_cache), tables, ends = cache_and_tables(8, 128, torch.bfloat16, lengths,
                                                        stale=float("nan"))
    q = queries(len(lengths), 16, 128, torch.bfloat16)
    out = kernel(q, k_cache, v_cache, tables, ends, BLOCK)
    assert torch.isfinite(out).all()
    assert (out.float() - reference(q, k_cache, v_cache, tables, ends)).abs().max() < 2e-2


def test_the_kernel_refuses_a_cache_whose_heads_are_not_dense(kernel):
    (k_cache, v_cache), tables, ends = cache_and_tables(8, 128, torch.bfloat16, [4])
    q = queries(1, 16, 128, torch.bfloat16)
    with pytest.raises(ValueError, match="last dimension"):
        kernel(q, k_cache[:, :, ::2], v_cache[:, :, ::2], tables, ends, BLOCK)


@pytest.mark.parametrize("graphs", [False, True])
def test_an_engine_decoding_in_place_gives_the_tokens_of_one_gathering_its_keys(kernel, graphs):
    params = SamplingParams(max_tokens=24, temperature=0.0)
    prompts = {f"r{i}": [(11 * i + 3 * j) % 256 for j in range(2 + i % 7)] for i in range(9)}
    prompts["long"] = [(5 * j) % 256 for j in range(250)]  # decodes past the first bucket

    async def tokens(paged):
        engine = AsyncEngine(EngineConfig(model="tiny", device="cuda", cuda_graphs=graphs,
                                          paged_attention=paged))
        try:
            assert (engine.core.replica.runner.paged_decode is not None) == paged
            return await tokens_of(engine, prompts, params)
        finally:
            engine.shutdown()

    async def main():
        assert await tokens(True) == await tokens(False)
    run(main())


def test_a_step_of_prefills_and_decodes_attends_alike_in_place_and_gathered(kernel):
    """The decoding sequences of a mixed step (taken out of the batch and put back) through
    the kernel, the prefilling one through SDPA: every row as in a step that gathers."""
    gen = torch.Generator().manual_seed(2)
    heads, kv_heads, dim, slots = 8, 2, 64, 40 * BLOCK
    cache = [torch.randn(slots, kv_heads, dim, generator=gen) for _ in range(2)]
    for c in cache:
        c[-1] = 0  # (the slot nothing writes, read past a sequence's end when gathering)
    segments = [(0, 1, 20, 21, [3, 7]), (1, 6, 0, 5, [9]), (6, 7, 40, 41, [1, 2, 5])]
    q, k, v = (torch.randn(7, h, dim, generator=gen).cuda() for h in (heads, kv_heads, kv_heads))
    outs = []
    for paged in (True, False):
        kv = [tuple(c.clone().cuda() for c in cache)]
        batch = AttentionBatch.build(kv, segments, block_size=BLOCK, gqa_group=heads // kv_heads,
                                     head_dim=dim, theta=1e6, zero_slot=slots - 1,
                                     device=torch.device("cuda"),
                                     paged=kernel if paged else None)
        assert (batch.groups[0].paged is not None) == paged
        with torch.no_grad():
            outs.append(attend(q, k, v, 0, batch))
    torch.testing.assert_close(outs[0], outs[1])


def test_a_kernel_that_fails_its_trial_is_not_used(kernel, monkeypatch, caplog):
    def broken(module, device, dtype):
        raise RuntimeError("no compiler here")
    monkeypatch.setattr(layer_kernels, "_try_paged", broken)
    monkeypatch.setattr(layer_kernels, "_tried", {})
    assert layer_kernels.paged_decode_for(torch.device("cuda"), 128, torch.float16) is None
    assert "no compiler here" in caplog.text
    engine = AsyncEngine(EngineConfig(model="tiny", device="cuda"))
    try:
        assert engine.core.replica.runner.paged_decode is None
        out = run(collect(engine, "r", [1, 2, 3], SamplingParams(max_tokens=4, temperature=0)))
        assert len(out.outputs[0].token_ids) == 4
    finally:
        engine.shutdown()

