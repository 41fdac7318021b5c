"""The model: a Qwen3-style decoder (dense or MoE) in plain torch, its batched attention over
the paged KV cache, tensor/expert-parallel sharding, FP8 and LoRA layers."""

from wtransfer.inference.model.decoder import (
    MLP,
    Attention,
    DecoderBody,
    DecoderLayer,
    Qwen3ForCausalLM,
    RMSNorm,
    SparseMoE,
    load_model,
    save_pretrained,
    shard_model,
)

__all__ = ["MLP", "Attention", "DecoderBody", "DecoderLayer", "Qwen3ForCausalLM", "RMSNorm",
           "SparseMoE", "load_model", "save_pretrained", "shard_model"]
