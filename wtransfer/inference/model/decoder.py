"""A Qwen3/Llama-style decoder in plain torch, reading and writing Hugging Face checkpoints.

Parameter names are exactly the checkpoint's (``model.layers.0.self_attn.q_proj.weight``...), so
the trainer trains, and sends, the very module the engine serves. Attention reads and writes a
paged KV cache through an `AttentionBatch` the engine's runner lays out once per step
(`wtransfer.inference.model.attention`).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from wtransfer.errors import ConfigError, MetadataError
from wtransfer.inference.config import MODEL_CONFIGS, ModelConfig
from wtransfer.inference.model.attention import (
    AttentionBatch,
    attend,
    without_cudnn_attention,
)
from wtransfer.inference.model.eager_ops import rms_norm_eager
from wtransfer.inference.model.experts import Experts
from wtransfer.inference.model.fp8_linear import Fp8Linear, quantize_model
from wtransfer.inference.model.layer_kernels import fused_for
from wtransfer.inference.model.parallel import (
    ALONE,
    Parallel,
    check_fp8_shardable,
    check_shardable,
    layouts,
)
from wtransfer.packing import DTYPES


class RMSNorm(nn.Module):
    """Root-mean-square layer norm, computed in float32."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalize the last dimension."""
        fused = fused_for(x)
        if fused is not None:
            return fused.rms_norm(x.contiguous(), self.weight, self.eps)
        return rms_norm_eager(x, self.weight, self.eps)


class Attention(nn.Module):
    """Grouped-query attention with Qwen3's per-head q/k norms and rotary embeddings (a
    tensor-parallel rank holds its share of the heads and KV heads)."""

    def __init__(self, cfg: ModelConfig, layer: int, par: Parallel = ALONE) -> None:
        super().__init__()
        self.layer = layer
        self.par = par
        self.heads, self.kv_heads, self.head_dim = (cfg.num_attention_heads // par.size,
                                                    cfg.num_key_value_heads // par.size,
                                                    cfg.head_dim)
        self.theta = cfg.rope_theta
        self.q_proj = nn.Linear(cfg.hidden_size, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, cfg.hidden_size, bias=False)
        """Row-parallel: its outputs are summed over the ranks."""
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        """Attend the batch's new tokens to their sequences' cached context."""
        n = x.shape[0]
        q = self.q_norm(self.q_proj(x).view(n, self.heads, self.head_dim))
        k = self.k_norm(self.k_proj(x).view(n, self.kv_heads, self.head_dim))
        v = self.v_proj(x).view(n, self.kv_heads, self.head_dim)
        out = attend(q, k, v, self.layer, batch)
        return self.par.all_reduce(self.o_proj(out.reshape(n, self.heads * self.head_dim)))


class MLP(nn.Module):
    """SwiGLU feed-forward (a tensor-parallel rank holds its share of the width)."""

    def __init__(self, cfg: ModelConfig, par: Parallel = ALONE) -> None:
        super().__init__()
        self.par = par
        width = cfg.intermediate_size // par.size
        self.gate_proj = nn.Linear(cfg.hidden_size, width, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, width, bias=False)
        self.down_proj = nn.Linear(width, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """down(silu(gate(x)) * up(x)), summed over the ranks."""
        return self.par.all_reduce(self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x)))


class SparseMoE(nn.Module):
    """Qwen3-MoE's feed-forward: a router picks `num_experts_per_tok` experts per token, their
    SwiGLU outputs are summed with the routing weights (renormalized over the picked experts
    with `norm_topk_prob`). The order of the computation is transformers', so fp32 outputs
    match it; a rank computes the experts it holds and one all-reduce sums them."""

    def __init__(self, cfg: ModelConfig, par: Parallel = ALONE) -> None:
        super().__init__()
        self.par = par
        self.top_k, self.norm = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        """The router (replicated)."""
        self.experts = Experts(cfg, par)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Route, compute this rank's experts, sum over the ranks."""
        logits = F.linear(x, self.gate.weight)
        probs = F.softmax(logits, dtype=torch.float, dim=-1)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.norm:
            weights /= weights.sum(dim=-1, keepdim=True)
        weights = weights.to(logits.dtype)
        out = torch.zeros_like(x)
        experts = self.experts
        for local in range(experts.gate_up_proj.shape[0]):
            pick, token = torch.where((chosen == experts.first + local).T)
            if token.numel() == 0:
                continue
            gate, up = F.linear(x[token], experts.gate_up(local, x.dtype)).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, experts.down(local, x.dtype))
            out.index_add_(0, token, (y * weights[token, pick, None]).to(out.dtype))
        return self.par.all_reduce(out)


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP blocks with residuals."""

    def __init__(self, cfg: ModelConfig, layer: int, par: Parallel = ALONE) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer, par)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp: nn.Module = SparseMoE(cfg, par) if cfg.is_moe_layer(layer) else MLP(cfg, par)

    def forward(self, h: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        """One transformer block."""
        h = h + self.self_attn(self.input_layernorm(h), batch)
        return h + self.mlp(self.post_attention_layernorm(h))


class DecoderBody(nn.Module):
    """Embeddings, layers and the final norm (the checkpoint's ``model.`` prefix)."""

    def __init__(self, cfg: ModelConfig, par: Parallel = ALONE) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size // par.size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, par)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Qwen3ForCausalLM(nn.Module):
    """The policy: `forward` gives hidden states of the batch's tokens, `logits` projects them."""

    def __init__(self, cfg: ModelConfig, par: Parallel = ALONE) -> None:
        super().__init__()
        check_shardable(cfg, par)
        self.config = cfg
        self.par = par
        self.model = DecoderBody(cfg, par)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size // par.size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings; a vocabulary-parallel rank looks up the ids it holds, and an
        all-reduce fills in the rest."""
        if self.par.size == 1:
            return self.model.embed_tokens(input_ids)
        start, end = self.par.span(self.config.vocab_size)
        outside = (input_ids < start) | (input_ids >= end)
        h = self.model.embed_tokens(torch.where(outside, 0, input_ids - start))
        h[outside] = 0
        return self.par.all_reduce(h)

    def forward(self, input_ids: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        """Final hidden states [tokens, hidden] of the flat batch `input_ids`."""
        h = self.embed(input_ids)
        with without_cudnn_attention(h.device):
            for layer in self.model.layers:
                h = layer(h, batch)
        return self.model.norm(h)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Vocabulary logits (float32) of hidden states (gathered from every rank)."""
        return self.par.gather_last(self.lm_head(hidden)).float()

    def sequence_logits(self, sequences: list[list[int]]) -> list[torch.Tensor]:
        """Logits at every position of each full sequence, differentiable (for training):
        the same attention code as serving, over a scratch KV cache."""
        device = self.model.embed_tokens.weight.device
        total = sum(len(s) for s in sequences)
        cfg = self.config
        shape = (total + 1, cfg.num_key_value_heads, cfg.head_dim)  # + a slot of zeros
        dtype = self.model.embed_tokens.weight.dtype
        kv = [(torch.zeros(shape, dtype=dtype, device=device),
               torch.zeros(shape, dtype=dtype, device=device))
              for _ in range(cfg.num_hidden_layers)]
        segments, start = [], 0
        for seq in sequences:
            segments.append((start, start + len(seq), 0, len(seq),
                             list(range(start, start + len(seq)))))
            start += len(seq)
        batch = AttentionBatch.build(kv, segments, block_size=1,
                                     gqa_group=cfg.num_attention_heads // cfg.num_key_value_heads,
                                     head_dim=cfg.head_dim, theta=cfg.rope_theta,
                                     zero_slot=total, device=device)
        flat = torch.tensor([t for s in sequences for t in s], dtype=torch.long, device=device)
        logits = self.logits(self(flat, batch))
        return [logits[a:b] for a, b, *_ in segments]

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors in place: fused ``qkv_proj``/``gate_up_proj`` are split, a
        checkpoint's per-expert tensors go into their rows of the fused experts (a model that
        is not split: shards are taken from a whole one, `shard_model`)."""
        own = self.state_dict(keep_vars=True)
        for name, tensor in weights:
            for part, index, piece in self._places(name, tensor):
                dest = own.get(part)
                if dest is None:
                    raise MetadataError(f"checkpoint tensor {name!r} has no place in this model")
                view = dest.data if index is None else dest.data[index]
                if view.shape != piece.shape:
                    raise MetadataError(f"checkpoint tensor {name!r} has shape "
                                        f"{list(piece.shape)}, model expects {list(view.shape)}")
                view.copy_(piece)

    def _places(self, name: str, tensor: torch.Tensor
                ) -> list[tuple[str, Any, torch.Tensor]]:
        """Where a checkpoint tensor goes: (parameter, index into it or None, the piece)."""
        cfg = self.config
        if name.endswith("self_attn.qkv_proj.weight"):
            base = name.removesuffix("qkv_proj.weight")
            q = cfg.num_attention_heads * cfg.head_dim
            kv = cfg.num_key_value_heads * cfg.head_dim
            parts = tensor.split([q, kv, kv], dim=0)
            return [(base + f"{p}_proj.weight", None, t)
                    for p, t in zip("qkv", parts, strict=True)]
        if name.endswith("mlp.gate_up_proj.weight"):
            base = name.removesuffix("gate_up_proj.weight")
            gate, up = tensor.chunk(2, dim=0)
            return [(base + "gate_proj.weight", None, gate), (base + "up_proj.weight", None, up)]
        expert = _EXPERT.fullmatch(name)
        if expert is not None:
            base, index, proj = expert.group(1), int(expert.group(2)), expert.group(3)
            width = cfg.moe_intermediate_size
            if proj == "down":
                return [(base + "down_proj", index, tensor)]
            rows = slice(0, width) if proj == "gate" else slice(width, 2 * width)
            return [(base + "gate_up_proj", (index, rows), tensor)]
        return [(name, None, tensor)]

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """The state dict under a checkpoint's names: fused experts as one tensor per expert
        and projection, as Hugging Face checkpoints store them (`save_pretrained`)."""
        out: dict[str, torch.Tensor] = {}
        width = self.config.moe_intermediate_size
        for name, tensor in self.state_dict().items():
            if name.endswith("mlp.experts.gate_up_proj"):
                base = name.removesuffix("gate_up_proj")
                for e in range(tensor.shape[0]):
                    out[f"{base}{e}.gate_proj.weight"] = tensor[e, :width]
                    out[f"{base}{e}.up_proj.weight"] = tensor[e, width:]
            elif name.endswith("mlp.experts.down_proj"):
                base = name.removesuffix("down_proj")
                for e in range(tensor.shape[0]):
                    out[f"{base}{e}.down_proj.weight"] = tensor[e]
            else:
                out[name] = tensor
        return out


_EXPERT = re.compile(r"(.*\.mlp\.experts\.)(\d+)\.(gate|up|down)_proj\.weight")
"""A checkpoint's per-expert tensor: the experts' prefix, the expert, the projection."""


def shard_model(full: Qwen3ForCausalLM, par: Parallel) -> Qwen3ForCausalLM:
    """Rank `par.rank`'s shard of the whole model `full` (same names, sharded shapes: the
    slices `wtransfer.inference.model.parallel.layouts` gives). A quantized `full` (FP8
    projections) gives a quantized shard: its part of each FP8 weight and of its scales."""
    shard = Qwen3ForCausalLM(full.config, par).to(full.model.embed_tokens.weight.dtype)
    if any(isinstance(m, Fp8Linear) for m in full.modules()):
        check_fp8_shardable(full.config, par.size, expert=par.expert)
        quantize_model(shard)  # the same modules, sharded shapes; the values come next
    state = full.state_dict()
    kept = layouts(full.config, par, state)
    with torch.no_grad():
        for name, tensor in shard.state_dict(keep_vars=True).items():
            tensor.data.copy_(kept[name].take(state[name]))
    return shard.eval()


def _init_random(model: nn.Module, seed: int) -> None:
    """Fill `model` from `seed`: each parameter from a generator of its own (seeded by
    `seed` and its place in the model), drawn on the host whatever the device (so every
    device gets the same values), the parameters several at a time (a 16 GB model takes a
    fraction of one sequential draw's minutes)."""

    @torch.no_grad()  # (per thread)
    def fill(number: int, name: str, param: torch.Tensor) -> None:
        if name.endswith("norm.weight"):
            param.fill_(1.0)
            return  # unit-variance activations: outputs depend visibly on every weight
        scale = 1.0 if param.dim() == 1 or "embed" in name else param.shape[-1] ** -0.5
        gen = torch.Generator().manual_seed(seed * 1_000_003 + number)
        param.copy_(torch.randn(param.shape, generator=gen) * scale)

    cpus = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
            else os.cpu_count() or 1)  # the CPUs this process may use (not OMP's count)
    with ThreadPoolExecutor(max(1, min(8, cpus))) as pool:
        for done in [pool.submit(fill, i, n, p)
                     for i, (n, p) in enumerate(model.named_parameters())]:
            done.result()


def load_model(name_or_path: str, *, device: str = "cpu", dtype: str | None = None,
               seed: int = 0) -> Qwen3ForCausalLM:
    """A named random model (from `seed`) or a Hugging Face checkpoint directory."""
    path = Path(name_or_path)
    if name_or_path in MODEL_CONFIGS:
        cfg = MODEL_CONFIGS[name_or_path]
        with torch.device("meta"):  # no default init: every parameter is drawn below
            model = Qwen3ForCausalLM(cfg)
        model = model.to(dtype=_dtype(dtype or cfg.torch_dtype)).to_empty(device=device)
        if cfg.tie_word_embeddings:  # to_empty gave each module its own tensor
            model.lm_head.weight = model.model.embed_tokens.weight
        _init_random(model, seed)
        return model.eval()
    if (path / "config.json").is_file():
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
    return model.to(device=device, dtype=_dtype(dtype or cfg.torch_dtype)).eval()


def _dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ConfigError(f"unknown dtype {name!r}")
    return DTYPES[name]


def save_pretrained(model: Qwen3ForCausalLM, directory: str | Path) -> Path:
    """Write config.json and model.safetensors in the Hugging Face layout."""
    from safetensors.torch import save_file

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(model.config.to_hf(), indent=2))
    state = {k: v.detach().contiguous().cpu() for k, v in model.checkpoint_tensors().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(out / "model.safetensors"))
    return out
