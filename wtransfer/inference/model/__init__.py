"""The model: a Qwen3-style decoder (dense or MoE) in plain torch, its batched attention over
the paged KV cache, tensor/expert-parallel sharding and FP8 layers."""

from wtransfer.inference.model.decoder import (
    Qwen3ForCausalLM,
    load_model,
    save_pretrained,
    shard_model,
)

__all__ = ["Qwen3ForCausalLM", "load_model", "save_pretrained", "shard_model"]
