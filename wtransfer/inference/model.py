"""A Qwen3/Llama-style decoder in plain torch, reading and writing Hugging Face checkpoints.

Parameter names are exactly the checkpoint's (``model.layers.0.self_attn.q_proj.weight``...), so
the trainer trains, and sends, the very module the engine serves. Attention reads and writes a
paged KV cache through an `AttentionBatch` that the engine's runner builds for each step.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from wtransfer.errors import ConfigError, MetadataError
from wtransfer.inference.config import MODEL_CONFIGS, ModelConfig
from wtransfer.packing import DTYPES


@dataclass
class Segment:
    """One sequence's tokens in a step: rows [start, end) of the flat batch."""

    start: int
    end: int
    slots: torch.Tensor
    """KV-cache slot of each new token."""
    context_slots: torch.Tensor
    """KV-cache slots of every position 0..T-1 the new tokens attend to (new ones included)."""
    positions: torch.Tensor
    """Absolute position of each new token."""


@dataclass
class AttentionBatch:
    """The paged KV cache (one (K, V) pair of [slots, kv_heads, head_dim] per layer) and the
    segments of the tokens being computed."""

    kv: Sequence[tuple[torch.Tensor, torch.Tensor]]
    segments: Sequence[Segment]


class RMSNorm(nn.Module):
    """Root-mean-square layer norm, computed in float32."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalize the last dimension."""
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


def _rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    dim = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, device=x.device, dtype=torch.float32) / dim))
    freqs = positions.to(torch.float32)[:, None] * inv[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)[:, None, :]
    xf = x.float()
    half = torch.cat([-xf[..., dim // 2 :], xf[..., : dim // 2]], dim=-1)
    return (xf * emb.cos() + half * emb.sin()).to(x.dtype)


class Attention(nn.Module):
    """Grouped-query attention with Qwen3's per-head q/k norms and rotary embeddings."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.heads, self.kv_heads, self.head_dim = (cfg.num_attention_heads,
                                                    cfg.num_key_value_heads, cfg.head_dim)
        self.theta = cfg.rope_theta
        self.q_proj = nn.Linear(cfg.hidden_size, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        """Attend each segment's new tokens to its cached context."""
        n = x.shape[0]
        q = self.q_norm(self.q_proj(x).view(n, self.heads, self.head_dim))
        k = self.k_norm(self.k_proj(x).view(n, self.kv_heads, self.head_dim))
        v = self.v_proj(x).view(n, self.kv_heads, self.head_dim)
        k_cache, v_cache = batch.kv[self.layer]
        out = torch.empty_like(q)
        group = self.heads // self.kv_heads
        for seg in batch.segments:
            qs = _rotate(q[seg.start : seg.end], seg.positions, self.theta)
            k_cache[seg.slots] = _rotate(k[seg.start : seg.end], seg.positions, self.theta)
            v_cache[seg.slots] = v[seg.start : seg.end]
            keys = k_cache[seg.context_slots].repeat_interleave(group, dim=1)
            values = v_cache[seg.context_slots].repeat_interleave(group, dim=1)
            mask = None
            if seg.end - seg.start > 1:
                key_pos = torch.arange(keys.shape[0], device=x.device)
                mask = key_pos[None, :] <= seg.positions[:, None]
            att = F.scaled_dot_product_attention(qs.transpose(0, 1), keys.transpose(0, 1),
                                                 values.transpose(0, 1), attn_mask=mask)
            out[seg.start : seg.end] = att.transpose(0, 1)
        return self.o_proj(out.reshape(n, self.heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU feed-forward."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """down(silu(gate(x)) * up(x))."""
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP blocks with residuals."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, h: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        """One transformer block."""
        h = h + self.self_attn(self.input_layernorm(h), batch)
        return h + self.mlp(self.post_attention_layernorm(h))


class DecoderBody(nn.Module):
    """Embeddings, layers and the final norm (the checkpoint's ``model.`` prefix)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Qwen3ForCausalLM(nn.Module):
    """The policy: `forward` gives hidden states of the batch's tokens, `logits` projects them."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = DecoderBody(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        """Final hidden states [tokens, hidden] of the flat batch `input_ids`."""
        h = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            h = layer(h, batch)
        return self.model.norm(h)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Vocabulary logits (float32) of hidden states."""
        return self.lm_head(hidden).float()

    def sequence_logits(self, sequences: list[list[int]]) -> list[torch.Tensor]:
        """Logits at every position of each full sequence, differentiable (for training):
        the same attention code as serving, over a scratch KV cache."""
        device = self.model.embed_tokens.weight.device
        total = sum(len(s) for s in sequences)
        cfg = self.config
        shape = (total, cfg.num_key_value_heads, cfg.head_dim)
        dtype = self.model.embed_tokens.weight.dtype
        kv = [(torch.zeros(shape, dtype=dtype, device=device),
               torch.zeros(shape, dtype=dtype, device=device))
              for _ in range(cfg.num_hidden_layers)]
        segments, start = [], 0
        for seq in sequences:
            slots = torch.arange(start, start + len(seq), device=device)
            segments.append(Segment(start, start + len(seq), slots, slots,
                                    torch.arange(len(seq), device=device)))
            start += len(seq)
        flat = torch.tensor([t for s in sequences for t in s], dtype=torch.long, device=device)
        logits = self.logits(self(flat, AttentionBatch(kv, segments)))
        return [logits[seg.start : seg.end] for seg in segments]

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors in place; fused ``qkv_proj``/``gate_up_proj`` are split."""
        own = self.state_dict(keep_vars=True)
        for name, tensor in weights:
            for part, piece in self._split_fused(name, tensor):
                dest = own.get(part)
                if dest is None:
                    raise MetadataError(f"checkpoint tensor {part!r} has no place in this model")
                if dest.shape != piece.shape:
                    raise MetadataError(f"checkpoint tensor {part!r} has shape "
                                        f"{list(piece.shape)}, model expects {list(dest.shape)}")
                dest.data.copy_(piece)

    def _split_fused(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        cfg = self.config
        if name.endswith("self_attn.qkv_proj.weight"):
            base = name.removesuffix("qkv_proj.weight")
            q = cfg.num_attention_heads * cfg.head_dim
            kv = cfg.num_key_value_heads * cfg.head_dim
            parts = tensor.split([q, kv, kv], dim=0)
            return [(base + f"{p}_proj.weight", t) for p, t in zip("qkv", parts, strict=True)]
        if name.endswith("mlp.gate_up_proj.weight"):
            base = name.removesuffix("gate_up_proj.weight")
            gate, up = tensor.chunk(2, dim=0)
            return [(base + "gate_proj.weight", gate), (base + "up_proj.weight", up)]
        return [(name, tensor)]


def _init_random(model: nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:  # unit-variance activations: outputs depend visibly on every weight
                scale = 1.0 if param.dim() == 1 or "embed" in name else param.shape[1] ** -0.5
                param.copy_(torch.randn(param.shape, generator=gen) * scale)


def load_model(name_or_path: str, *, device: str = "cpu", dtype: str | None = None,
               seed: int = 0) -> Qwen3ForCausalLM:
    """A named random model (from `seed`) or a Hugging Face checkpoint directory."""
    path = Path(name_or_path)
    if name_or_path in MODEL_CONFIGS:
        cfg = MODEL_CONFIGS[name_or_path]
        model = Qwen3ForCausalLM(cfg)
        _init_random(model, seed)
    elif (path / "config.json").is_file():
        cfg = ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
        model = Qwen3ForCausalLM(cfg)
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise ConfigError(f"{path} has a config.json but no *.safetensors files")
        from safetensors.torch import load_file

        for file in files:
            model.load_weights(load_file(str(file)).items())
    else:
        raise ConfigError(f"unknown model {name_or_path!r}: not one of {sorted(MODEL_CONFIGS)} "
                          "and not a directory holding config.json + *.safetensors")
    target = dtype or cfg.torch_dtype
    if target not in DTYPES:
        raise ConfigError(f"unknown dtype {target!r}")
    return model.to(device=device, dtype=DTYPES[target]).eval()


def save_pretrained(model: Qwen3ForCausalLM, directory: str | Path) -> Path:
    """Write config.json and model.safetensors in the Hugging Face layout."""
    from safetensors.torch import save_file

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(model.config.to_hf(), indent=2))
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(out / "model.safetensors"))
    return out
