"""Configuration of the inference engine and of the models it serves (torch-free)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from wtransfer.errors import ConfigError
from wtransfer.shapes import MODEL_SHAPES


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Shapes of a Qwen3/Llama-style decoder; field names follow Hugging Face config.json."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    torch_dtype: str = "float32"
    num_experts: int = 0
    """Mixture of experts (Qwen3-MoE): experts per MoE layer; 0 is a dense model."""
    num_experts_per_tok: int = 0
    """Experts each token is routed to."""
    moe_intermediate_size: int = 0
    """The feed-forward width of one expert."""
    norm_topk_prob: bool = True
    """Renormalize the routing weights of the chosen experts to sum to one."""
    decoder_sparse_step: int = 1
    """Every this many layers is an MoE layer (the others dense), as in Qwen3-MoE."""
    mlp_only_layers: tuple[int, ...] = ()
    """Layers that stay dense whatever `decoder_sparse_step` says."""

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer `layer` routes its tokens to experts."""
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "intermediate_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"model config: {name} must be >= 1")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError("model config: num_attention_heads must be a multiple of "
                              "num_key_value_heads")
        if self.num_experts and not (0 < self.num_experts_per_tok <= self.num_experts
                                     and self.moe_intermediate_size > 0
                                     and self.decoder_sparse_step > 0):
            raise ConfigError("model config: an MoE model needs 0 < num_experts_per_tok <= "
                              "num_experts, moe_intermediate_size > 0, decoder_sparse_step > 0")

    @classmethod
    def from_hf(cls, data: dict[str, Any]) -> ModelConfig:
        """Read the fields this engine uses from a Hugging Face config.json dict."""
        known = {f.name for f in fields(cls)}
        data = {**data}
        for old, new in (("num_local_experts", "num_experts"), ("dtype", "torch_dtype")):
            if old in data and new not in data:  # transformers 5 names
                data[new] = data[old]
        rope = data.get("rope_parameters")
        if isinstance(rope, dict) and "rope_theta" in rope and "rope_theta" not in data:
            data["rope_theta"] = rope["rope_theta"]
        values = {k: v for k, v in data.items() if k in known}
        if "head_dim" not in values and "hidden_size" in data and "num_attention_heads" in data:
            values["head_dim"] = data["hidden_size"] // data["num_attention_heads"]
        values.setdefault("num_key_value_heads", data.get("num_attention_heads"))
        if "mlp_only_layers" in values:
            values["mlp_only_layers"] = tuple(values["mlp_only_layers"])
        try:
            return cls(**values)
        except TypeError as exc:
            raise ConfigError(f"config.json is missing fields this engine needs: {exc}") from None

    def to_hf(self) -> dict[str, Any]:
        """A Hugging Face style config.json dict (Qwen3, or Qwen3-MoE with experts)."""
        fields = asdict(self)
        if not self.num_experts:
            return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
                    **{k: v for k, v in fields.items() if k not in _MOE_FIELDS}}
        return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
                **fields, "mlp_only_layers": list(self.mlp_only_layers)}


_MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
               "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers")


_TINY_FP8 = ModelConfig(vocab_size=256, hidden_size=128, num_hidden_layers=2,
                        num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                        intermediate_size=512, tie_word_embeddings=False,
                        max_position_embeddings=2048)

MODEL_CONFIGS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                        intermediate_size=128, tie_word_embeddings=False,
                        max_position_embeddings=2048),
    "tiny32": ModelConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                          intermediate_size=128, tie_word_embeddings=False,
                          max_position_embeddings=2048),
    "tiny-moe": ModelConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            intermediate_size=128, tie_word_embeddings=False,
                            max_position_embeddings=2048, num_experts=4,
                            num_experts_per_tok=2, moe_intermediate_size=32),
    "tiny-fp8": _TINY_FP8,
    "tiny-moe-fp8": replace(_TINY_FP8, num_experts=4, num_experts_per_tok=2,
                            moe_intermediate_size=256),
    "small": ModelConfig(vocab_size=512, hidden_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                         intermediate_size=384, tie_word_embeddings=True,
                         max_position_embeddings=2048),
    **{name: ModelConfig(vocab_size=shape["vocab"], hidden_size=shape["hidden"],
                         num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
                         num_key_value_heads=shape["kv_heads"], head_dim=shape["head_dim"],
                         intermediate_size=shape["intermediate"],
                         tie_word_embeddings=bool(shape["tied"]),
                         max_position_embeddings=40960, torch_dtype="bfloat16")
       for name, shape in MODEL_SHAPES.items()},
}
"""Named random-weight models: "tiny" for tests, "tiny-moe" (Qwen3-MoE, 4 experts, 2 per
token), "tiny32" where an engine needs head_dim >= 32 (vLLM's CPU attention), "tiny-fp8" whose
tensor-parallel halves are whole 128 x 128 blocks (FP8 with 2 workers), "tiny-moe-fp8" the
same for a Qwen3-MoE (4 experts, each worker's half of an expert whole blocks), and the real
Qwen3 checkpoints' shapes of the one catalog `wtransfer.shapes.MODEL_SHAPES` for benchmarks
(qwen3-8b on a GPU: 16 GB of random weights)."""


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """Everything `AsyncEngine` needs; validated on construction."""

    model: str = "tiny"
    """A name in MODEL_CONFIGS (random weights from `seed`) or a checkpoint directory."""
    device: str = "cpu"
    dtype: str | None = None
    """Parameter dtype; default: the model config's."""
    max_loras: int = 0
    """LoRA adapter slots (`wtransfer.inference.updates.lora`); 0: no adapters."""
    max_lora_rank: int = 16
    """The largest adapter rank a slot holds."""
    quantization: str | None = None
    """"fp8": the attention and MLP projections stored as float8_e4m3fn with 128 x 128 block
    scales (`wtransfer.quant.fp8`), dequantized in the forward; fed by a trainer in the
    checkpoint's dtype (quantized as each tensor lands) or already quantized (`Fp8Source`).
    Dense models, one worker per replica (no tensor parallelism yet)."""
    seed: int = 0
    weight_transfer_backend: str = "ipc"
    block_size: int = 16
    num_kv_blocks: int = 1024
    kv_cache_memory_fraction: float | None = None
    """On CUDA: size the KV cache to this fraction of the device memory free once the weights
    (and the shadow) are in place, instead of `num_kv_blocks` (`wtransfer serve --device cuda`
    uses 0.8 unless given --num-kv-blocks). One worker per engine."""
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 4096
    """Token budget of one step; a prompt (plus tokens so far, on re-prefill) must fit in it."""
    enable_prefix_caching: bool = True
    cuda_graphs: bool = True
    """Replay decode steps as CUDA graphs where they apply (CUDA, one worker, a dense model,
    no adapters: `wtransfer.inference.steps.decode_graphs`); False: every step eager."""
    paged_attention: bool = True
    """On CUDA where Triton imports, for heads of 16 to 256 values (a power of two) in bf16,
    fp16 or fp32: decode attention reads each sequence's keys in place from the paged cache,
    one kernel per layer for the batch (`wtransfer.inference.model.paged_decode`); False, or
    elsewhere: the keys are gathered (up to the context bucket in a decode graph) for SDPA."""
    batch_invariant: bool = False
    """Compute each sequence on its own so its tokens never depend on its batch-mates (and turn
    prefix caching off, whose cached blocks come from other sequences' computations)."""
    data_parallel_size: int = 1
    tensor_parallel_size: int = 1
    """Worker processes per data-parallel rank, each holding a slice of every matrix (heads,
    feed-forward width and vocabulary split; one all-reduce per attention and MLP block)."""
    enable_expert_parallel: bool = False
    """An MoE model's experts split across the tensor-parallel workers (each keeps only its
    experts) instead of each expert's width."""
    dp_sync_interval: int = 32
    step_timeout_s: float = 60.0
    """Deadline of pause and resume (a wait-mode pause includes draining running requests)."""
    call_timeout_s: float = 600.0
    """Deadline of every other call into the engine thread, weight transfers included."""
    update_rollback: bool | None = None
    """Keep a host copy of each tensor an update overwrites and restore them all when the
    update fails or is abandoned, so the engine returns to its old weights and can resume.
    None (default): on when the model fits in half of the host's available memory."""
    update_staging: str | None = None
    """Where updates land: "off" (in place, the engine paused or idle), "swap" or "copy"
    (into a shadow copy while the engine keeps generating, committed at a step boundary by
    exchanging storages, or by copying into the live ones: `wtransfer.inference.updates.staging`).
    None (default): "swap" when the extra copy fits in half the free memory of the device,
    else "off"."""
    update_reprefill: bool = True
    """At a staged commit (and a rollback), re-prefill the requests in flight so that every
    token after it is computed with the new weights; False keeps their (stale) KV."""

    def __post_init__(self) -> None:
        for name in ("block_size", "num_kv_blocks", "max_num_seqs", "max_num_batched_tokens",
                     "data_parallel_size", "tensor_parallel_size", "dp_sync_interval"):
            if getattr(self, name) < 1:
                raise ConfigError(f"EngineConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.update_staging not in (None, "off", "swap", "copy"):
            raise ConfigError(f"EngineConfig.update_staging must be 'off', 'swap', 'copy' or "
                              f"None (auto), got {self.update_staging!r}")
        if self.quantization not in (None, "fp8"):
            raise ConfigError(f"EngineConfig.quantization must be 'fp8' or None, got "
                              f"{self.quantization!r}")
        if self.max_loras < 0 or self.max_lora_rank < 1:
            raise ConfigError("EngineConfig.max_loras must be >= 0 and max_lora_rank >= 1")
        if self.max_loras and self.update_staging == "off":
            raise ConfigError("LoRA adapters (max_loras > 0) land in the staging shadow, so a "
                              "failed adapter update never leaves one half written: use "
                              "update_staging 'swap' or 'copy', or leave it unset")
        if self.max_loras and self.tensor_parallel_size > 1:
            raise ConfigError("LoRA adapters (max_loras > 0) are served with "
                              "tensor_parallel_size=1 for now")
        if self.update_rollback not in (None, True, False):
            raise ConfigError(f"EngineConfig.update_rollback must be True, False or None "
                              f"(auto), got {self.update_rollback!r}")
        fraction = self.kv_cache_memory_fraction
        if fraction is not None and not (math.isfinite(fraction) and 0 < fraction <= 0.95):
            raise ConfigError(f"EngineConfig.kv_cache_memory_fraction must be in (0, 0.95], "
                              f"got {fraction!r}")
        if fraction is not None and (self.tensor_parallel_size > 1
                                     or self.data_parallel_size > 1):
            raise ConfigError("kv_cache_memory_fraction sizes one worker's KV cache; with "
                              "tensor or data parallelism give num_kv_blocks")
        for name in ("step_timeout_s", "call_timeout_s"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) > 0):
                raise ConfigError(f"EngineConfig.{name} must be a positive number")

    @property
    def prefix_caching(self) -> bool:
        """Whether the prefix cache is used (never in batch-invariant mode, nor with adapters:
        the same tokens under another adapter have other keys and values)."""
        return self.enable_prefix_caching and not self.batch_invariant and not self.max_loras
