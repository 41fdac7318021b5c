"""Realistic parameter lists (real Qwen3 shapes, a mixed-dtype model) and modules that hold
them, for the demos, benchmarks and tests."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from wtransfer.errors import ConfigError
from wtransfer.packing import DTYPES, TensorMeta, is_dtensor


def qwen3_metas(
    *, layers: int, hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int,
    vocab: int, dtype: str = "bfloat16", tied: bool = False,
) -> list[TensorMeta]:
    """The parameter list of a Qwen3-style decoder with these shapes (Hugging Face names)."""
    metas = [TensorMeta("model.embed_tokens.weight", dtype, (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        metas += [
            TensorMeta(p + "input_layernorm.weight", dtype, (hidden,)),
            TensorMeta(p + "self_attn.q_proj.weight", dtype, (heads * head_dim, hidden)),
            TensorMeta(p + "self_attn.k_proj.weight", dtype, (kv_heads * head_dim, hidden)),
            TensorMeta(p + "self_attn.v_proj.weight", dtype, (kv_heads * head_dim, hidden)),
            TensorMeta(p + "self_attn.o_proj.weight", dtype, (hidden, heads * head_dim)),
            TensorMeta(p + "self_attn.q_norm.weight", dtype, (head_dim,)),
            TensorMeta(p + "self_attn.k_norm.weight", dtype, (head_dim,)),
            TensorMeta(p + "post_attention_layernorm.weight", dtype, (hidden,)),
            TensorMeta(p + "mlp.gate_proj.weight", dtype, (intermediate, hidden)),
            TensorMeta(p + "mlp.up_proj.weight", dtype, (intermediate, hidden)),
            TensorMeta(p + "mlp.down_proj.weight", dtype, (hidden, intermediate)),
        ]
    metas.append(TensorMeta("model.norm.weight", dtype, (hidden,)))
    if not tied:
        metas.append(TensorMeta("lm_head.weight", dtype, (vocab, hidden)))
    return metas


MODEL_SHAPES = {
    "qwen3-0.6b": dict(layers=28, hidden=1024, heads=16, kv_heads=8, head_dim=128,
                       intermediate=3072, vocab=151936, tied=True),
    "qwen3-1.7b": dict(layers=28, hidden=2048, heads=16, kv_heads=8, head_dim=128,
                       intermediate=6144, vocab=151936, tied=True),
    "qwen3-8b": dict(layers=36, hidden=4096, heads=32, kv_heads=8, head_dim=128,
                     intermediate=12288, vocab=151936, tied=False),
}
"""Shapes of real Qwen3 checkpoints (from their config.json files), for benchmarks."""

DEMO_SHAPE = dict(layers=8, hidden=512, heads=8, kv_heads=4, head_dim=64, intermediate=1536,
                  vocab=32000, tied=False)
"""A small Qwen3-style decoder (about 58M parameters, 116 MB in bf16) for the demo."""


def mixed_metas(layers: int = 24) -> list[TensorMeta]:
    """A small but realistic mix: a Qwen3-style bf16 decoder plus fp32 norms, fp8 weights with
    fp32 scales, int/bool buffers, 0-d and empty tensors; the embedding is 512 KiB."""
    metas = []
    for m in qwen3_metas(layers=layers, hidden=64, heads=4, kv_heads=2, head_dim=16,
                         intermediate=128, vocab=4096):
        norm = m.name.endswith("norm.weight")
        metas.append(TensorMeta(m.name, "float32" if norm else m.dtype, m.shape))
    for i in range(0, layers, 4):
        p = f"model.layers.{i}.mlp.quant."
        metas += [
            TensorMeta(p + "qweight", "float8_e4m3fn", (64, 96)),
            TensorMeta(p + "scale", "float32", (64,)),
            TensorMeta(p + "zero_point", "int8", (64,)),
            TensorMeta(p + "group_index", "int64", (96,)),
            TensorMeta(p + "mask", "bool", (7,)),
            TensorMeta(p + "step", "int32", ()),
            TensorMeta(p + "unused", "float16", (0, 5)),
            TensorMeta(p + "freqs", "float64", (3, 5)),
        ]
    return metas


class _Node(nn.Module):
    """A plain container so dotted names become nested modules."""


def build_module(metas: Sequence[TensorMeta], seed: int, device: str = "cpu",
                 *, fill: str = "random") -> nn.Module:
    """An `nn.Module` whose state dict has exactly `metas` (floats as parameters, others as
    buffers), filled with values drawn from `seed` (``fill="constant"``: one value per tensor,
    derived from `seed`, which builds multi-GB models in seconds). Random values are drawn on
    `device` (`randomize`): CPU and CUDA builds of one seed differ."""
    root = _Node()
    for meta in metas:
        *path, leaf = meta.name.split(".")
        node: nn.Module = root
        for part in path:
            child = getattr(node, part, None)
            if not isinstance(child, nn.Module):
                child = _Node()
                node.add_module(part, child)
            node = child
        tensor = torch.empty(meta.shape, dtype=DTYPES[meta.dtype], device=device)
        if tensor.is_floating_point() and meta.itemsize >= 2:
            node.register_parameter(leaf, nn.Parameter(tensor, requires_grad=False))
        else:
            node.register_buffer(leaf, tensor)
    if fill == "constant":
        with torch.no_grad():
            for i, t in enumerate(root.state_dict(keep_vars=True).values()):
                t.data.fill_((seed * 7919 + i) % 97 / 7)
    else:
        randomize(root, seed)
    return root


@torch.no_grad()
def randomize(module: nn.Module, seed: int) -> None:
    """Refill every tensor of `module` in place with values drawn from `seed` where it lives (one
    generator per device: the same values on every rank of one device type, other values on CPU
    than on CUDA); a sharded tensor gets its rows of the same full tensor on every rank."""
    generators: dict[torch.device, torch.Generator] = {}
    for tensor in module.state_dict(keep_vars=True).values():
        t = tensor.data
        device = t.device
        if device not in generators:
            generators[device] = torch.Generator(device=device).manual_seed(seed)
        gen = generators[device]
        if t.dtype == torch.bool:
            fresh = torch.randint(0, 2, t.shape, generator=gen, device=device).bool()
        elif t.is_floating_point() or t.is_complex():
            fresh = torch.randn(t.shape, generator=gen, dtype=torch.float32,
                                device=device).to(t.dtype)
        else:
            fresh = torch.randint(-100, 100, t.shape, generator=gen, device=device).to(t.dtype)
        if is_dtensor(t):
            from torch.distributed.tensor import distribute_tensor

            fresh = distribute_tensor(fresh, t.device_mesh, t.placements)
        t.copy_(fresh)


@torch.no_grad()
def perturb(module: nn.Module, fraction: float, seed: int) -> int:
    """Flip the lowest bit of about `fraction` of every tensor's elements in place (at least one
    each, distinct positions from `seed`), as a small training step would; returns how many
    changed. A sharded tensor changes in this rank's shard only, at the same positions on each."""
    total = 0
    for number, tensor in enumerate(module.state_dict(keep_vars=True).values()):
        gen = torch.Generator().manual_seed(seed * 100_003 + number)  # each its own draws
        local = tensor.data.to_local() if is_dtensor(tensor.data) else tensor.data  # a shard:
        flat = local.reshape(-1)  # this rank's elements
        if flat.numel() == 0:
            continue
        count = max(1, int(fraction * flat.numel()))
        index = (torch.randperm(flat.numel(), generator=gen)[:count] if flat.numel() < 1 << 20
                 else torch.unique(torch.randint(flat.numel(), (count,), generator=gen))
                 ).to(flat.device)
        word = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[
            flat.element_size()]
        view = flat.view(word)
        view[index] ^= 1
        total += int(index.numel())
    return total


def model_metas(name: str) -> list[TensorMeta]:
    """The parameter list called `name`: "mixed" or a key of `MODEL_SHAPES`."""
    if name == "mixed":
        return mixed_metas()
    if name == "mixed-mismatch":  # one shape and one dtype differ from "mixed"
        metas = mixed_metas()
        bad = {5: TensorMeta(metas[5].name, metas[5].dtype, (*metas[5].shape[::-1], 1)),
               9: TensorMeta(metas[9].name, "float16", metas[9].shape)}
        return [bad.get(i, m) for i, m in enumerate(metas)]
    if name == "demo":
        return qwen3_metas(**DEMO_SHAPE)  # type: ignore[arg-type]
    if name in MODEL_SHAPES:
        return qwen3_metas(**MODEL_SHAPES[name])  # type: ignore[arg-type]
    raise ConfigError(f"unknown model {name!r}; choose mixed, mixed-mismatch, demo or one of "
                     f"{sorted(MODEL_SHAPES)}")
