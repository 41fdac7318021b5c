"""Tensor lists of the large MoE checkpoints the scale table plans for, from their public
config.json files: every tensor's name (as in the checkpoint: one tensor per expert), shape and
dtype (bf16, as a trainer holds them; the router's score bias in fp32).

* Qwen3-235B-A22B: 94 layers, hidden 4096, 64 query / 4 key-value heads of 128, 128 experts
  of width 1536 in every layer, vocabulary 151936 (about 235 B parameters).
* DeepSeek-V3: 61 layers (the first 3 dense, width 18432), hidden 7168, multi-head latent
  attention (128 heads; q rank 1536, kv rank 512, 128 + 64 query-key dims, 128 value dims),
  256 routed experts of width 2048 plus one shared, vocabulary 129280 (about 671 B; the
  multi-token-prediction layer is left out, as engines that do not speculate skip it).
* Kimi-K2: DeepSeek-V3's architecture with 64 heads, 384 routed experts, one dense layer and
  vocabulary 163840 (about 1.03 T).
"""

from __future__ import annotations

from wtransfer.errors import ConfigError
from wtransfer.packing import TensorMeta

BF16 = "bfloat16"


def _experts(prefix: str, experts: int, width: int, hidden: int) -> list[TensorMeta]:
    out = []
    for e in range(experts):
        p = f"{prefix}experts.{e}."
        out += [TensorMeta(p + "gate_proj.weight", BF16, (width, hidden)),
                TensorMeta(p + "up_proj.weight", BF16, (width, hidden)),
                TensorMeta(p + "down_proj.weight", BF16, (hidden, width))]
    return out


def qwen3_moe_metas(*, layers: int, hidden: int, heads: int, kv_heads: int, head_dim: int,
                    experts: int, width: int, vocab: int) -> list[TensorMeta]:
    """A Qwen3-MoE checkpoint's tensors (every layer sparse, no shared expert)."""
    metas = [TensorMeta("model.embed_tokens.weight", BF16, (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        metas += [
            TensorMeta(p + "input_layernorm.weight", BF16, (hidden,)),
            TensorMeta(p + "self_attn.q_proj.weight", BF16, (heads * head_dim, hidden)),
            TensorMeta(p + "self_attn.k_proj.weight", BF16, (kv_heads * head_dim, hidden)),
            TensorMeta(p + "self_attn.v_proj.weight", BF16, (kv_heads * head_dim, hidden)),
            TensorMeta(p + "self_attn.o_proj.weight", BF16, (hidden, heads * head_dim)),
            TensorMeta(p + "self_attn.q_norm.weight", BF16, (head_dim,)),
            TensorMeta(p + "self_attn.k_norm.weight", BF16, (head_dim,)),
            TensorMeta(p + "post_attention_layernorm.weight", BF16, (hidden,)),
            TensorMeta(p + "mlp.gate.weight", BF16, (experts, hidden)),
        ]
        metas += _experts(p + "mlp.", experts, width, hidden)
    metas += [TensorMeta("model.norm.weight", BF16, (hidden,)),
              TensorMeta("lm_head.weight", BF16, (vocab, hidden))]
    return metas


def deepseek_metas(*, layers: int, dense_layers: int, hidden: int, heads: int,
                   q_rank: int, kv_rank: int, nope: int, rope: int, v_dim: int,
                   dense_width: int, experts: int, width: int, vocab: int) -> list[TensorMeta]:
    """A DeepSeek-V3-style checkpoint's tensors (MLA attention, dense then sparse layers)."""
    metas = [TensorMeta("model.embed_tokens.weight", BF16, (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        metas += [
            TensorMeta(p + "input_layernorm.weight", BF16, (hidden,)),
            TensorMeta(a + "q_a_proj.weight", BF16, (q_rank, hidden)),
            TensorMeta(a + "q_a_layernorm.weight", BF16, (q_rank,)),
            TensorMeta(a + "q_b_proj.weight", BF16, (heads * (nope + rope), q_rank)),
            TensorMeta(a + "kv_a_proj_with_mqa.weight", BF16, (kv_rank + rope, hidden)),
            TensorMeta(a + "kv_a_layernorm.weight", BF16, (kv_rank,)),
            TensorMeta(a + "kv_b_proj.weight", BF16, (heads * (nope + v_dim), kv_rank)),
            TensorMeta(a + "o_proj.weight", BF16, (hidden, heads * v_dim)),
            TensorMeta(p + "post_attention_layernorm.weight", BF16, (hidden,)),
        ]
        m = p + "mlp."
        if i < dense_layers:
            metas += [TensorMeta(m + "gate_proj.weight", BF16, (dense_width, hidden)),
                      TensorMeta(m + "up_proj.weight", BF16, (dense_width, hidden)),
                      TensorMeta(m + "down_proj.weight", BF16, (hidden, dense_width))]
            continue
        metas += [TensorMeta(m + "gate.weight", BF16, (experts, hidden)),
                  TensorMeta(m + "gate.e_score_correction_bias", "float32", (experts,))]
        metas += _experts(m, experts, width, hidden)
        s = m + "shared_experts."
        metas += [TensorMeta(s + "gate_proj.weight", BF16, (width, hidden)),
                  TensorMeta(s + "up_proj.weight", BF16, (width, hidden)),
                  TensorMeta(s + "down_proj.weight", BF16, (hidden, width))]
    metas += [TensorMeta("model.norm.weight", BF16, (hidden,)),
              TensorMeta("lm_head.weight", BF16, (vocab, hidden))]
    return metas


_MLA = dict(q_rank=1536, kv_rank=512, nope=128, rope=64, v_dim=128, hidden=7168,
            dense_width=18432, width=2048, layers=61)

SCALE_MODELS = {
    "qwen3-235b-a22b": lambda: qwen3_moe_metas(layers=94, hidden=4096, heads=64, kv_heads=4,
                                               head_dim=128, experts=128, width=1536,
                                               vocab=151936),
    "deepseek-v3": lambda: deepseek_metas(**_MLA, dense_layers=3, heads=128, experts=256,
                                          vocab=129280),
    "kimi-k2": lambda: deepseek_metas(**_MLA, dense_layers=1, heads=64, experts=384,
                                      vocab=163840),
}
"""The large checkpoints by name (built on demand: Kimi-K2 lists about 70,000 tensors)."""


def scale_metas(name: str) -> list[TensorMeta]:
    """The tensor list of large model `name` (a key of `SCALE_MODELS`)."""
    build = SCALE_MODELS.get(name)
    if build is None:
        raise ConfigError(f"unknown large model {name!r}; choose one of {sorted(SCALE_MODELS)}")
    return build()
