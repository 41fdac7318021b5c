"""Layouts of whole clusters, for planning at scale without running them: what every trainer
rank holds and every engine worker keeps of each tensor, by the rules the systems use.

Trainer layouts (`trainer_layouts`, a spec string):

* ``fsdp:N``: FSDP2 over N ranks: every tensor cut into `torch.chunk` row shards.
* ``megatron:tp=T,pp=P,ep=E``: W ranks (given apart) in P pipeline stages of W/P ranks, each
  stage holding its share of the layers (the embedding on the first, the head on the last),
  its dense tensors split T ways by tensor parallelism (rank = ((stage * DP) + dp) * T + tp,
  so the T ranks of a group are neighbours, on one node) and replicated DP = W/(P*T) times;
  its experts split E ways by expert (E/... experts whole on each expert rank) and replicated
  W/(P*E) times.

Engine layouts (`engine_layouts`): R replicas of T workers (worker = replica * T + rank), the
dense tensors split T ways; experts split by expert over the T workers (``ep``) or each
expert's width split T ways.

Tensor-parallel rules (vLLM's and Megatron's alike): column-parallel (rows split) for q, k, v,
the MLA up-projections, gate and up, the embedding and the head; row-parallel (columns split)
for o and down; replicated for norms, routers and the MLA down-projections. Key/value
projections with fewer heads than ranks keep one head per rank, replicated.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from wtransfer.errors import ConfigError
from wtransfer.packing import TensorMeta
from wtransfer.records import Box, TensorLayout

HEAD_DIM = 128
"""Head width of every model the scale table plans (for key/value head replication)."""

_COLUMN = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "q_b_proj.weight",
           "kv_b_proj.weight", "gate_proj.weight", "up_proj.weight", "embed_tokens.weight",
           "lm_head.weight")
_ROW = ("o_proj.weight", "down_proj.weight")
_EXPERT = re.compile(r"\.experts\.(\d+)\.")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def _span(total: int, parts: int, index: int) -> tuple[int, int]:
    """`torch.chunk`'s piece `index` of `total` in `parts` (the last ones shorter or empty)."""
    step = -(-total // parts)
    start = min(total, index * step)
    return start, min(total, start + step)


def _box(meta: TensorMeta, dim: int, start: int, stop: int) -> Box:
    offsets, lengths = [0] * len(meta.shape), list(meta.shape)
    offsets[dim], lengths[dim] = start, stop - start
    return Box(offsets=tuple(offsets), lengths=tuple(lengths))


def _layout(meta: TensorMeta, box: Box, replica: int) -> TensorLayout:
    return TensorLayout(name=meta.name, dtype=meta.dtype, shape=meta.shape, boxes=(box,),
                        replica=replica)


def tp_layout(meta: TensorMeta, rank: int, size: int, replica: int = 0) -> TensorLayout:
    """What tensor-parallel rank `rank` of `size` keeps of `meta` (module docstring rules);
    `replica` tells apart copies of the same box held by several ranks."""
    whole = Box.whole(meta.shape)
    if size == 1 or not meta.shape:
        return _layout(meta, whole, replica)
    name = meta.name
    if name.endswith(("k_proj.weight", "v_proj.weight")) and meta.shape[0] // HEAD_DIM < size:
        heads = max(1, meta.shape[0] // HEAD_DIM)
        head = rank * heads // size
        return _layout(meta, _box(meta, 0, head * HEAD_DIM, (head + 1) * HEAD_DIM),
                       replica * size + rank)
    if name.endswith(_COLUMN):
        return _layout(meta, _box(meta, 0, *_span(meta.shape[0], size, rank)), replica)
    if name.endswith(_ROW) and len(meta.shape) == 2:
        return _layout(meta, _box(meta, 1, *_span(meta.shape[1], size, rank)), replica)
    return _layout(meta, whole, replica * size + rank)


def fsdp_layouts(metas: list[TensorMeta], ranks: int) -> list[dict[str, TensorLayout]]:
    """FSDP2 over `ranks`: every tensor's rows cut by `torch.chunk` (0-d tensors whole on
    every rank)."""
    out: list[dict[str, TensorLayout]] = [{} for _ in range(ranks)]
    for meta in metas:
        for r in range(ranks):
            if not meta.shape:
                out[r][meta.name] = _layout(meta, Box.whole(()), r)
            else:
                out[r][meta.name] = _layout(meta, _box(meta, 0, *_span(meta.shape[0], ranks,
                                                                        r)), 0)
    return out


def _layer_of(name: str) -> int | None:
    match = _LAYER.match(name)
    return int(match.group(1)) if match else None


def _expert_of(name: str) -> int | None:
    match = _EXPERT.search(name)
    return int(match.group(1)) if match else None


def megatron_layouts(metas: list[TensorMeta], world: int, tp: int, pp: int, ep: int
                     ) -> list[dict[str, TensorLayout]]:
    """Megatron-style TP x PP x EP over `world` ranks (module docstring)."""
    stage_width = world // pp
    if world % pp or stage_width % tp or stage_width % ep:
        raise ConfigError(f"megatron: world {world} must split into pp={pp} stages of a "
                          f"multiple of tp={tp} and of ep={ep} ranks")
    dp = stage_width // tp
    layers = 1 + max((_layer_of(m.name) or 0) for m in metas)
    experts = 1 + max((_expert_of(m.name) or 0) for m in metas)
    if ep > 1 and not any(_expert_of(m.name) is not None for m in metas):
        raise ConfigError(f"megatron: ep={ep} splits an MoE model's experts, and this model "
                          "is dense; leave ep out")
    if experts % ep:
        raise ConfigError(f"megatron: ep={ep} must divide the {experts} experts")
    out: list[dict[str, TensorLayout]] = [{} for _ in range(world)]
    for meta in metas:
        layer = _layer_of(meta.name)
        stage = (0 if meta.name.startswith("model.embed") else pp - 1 if layer is None
                 else layer * pp // layers)
        base = stage * stage_width
        expert = _expert_of(meta.name)
        if expert is not None:
            holder = expert // (experts // ep)
            for copy in range(stage_width // ep):
                rank = base + copy * ep + holder
                out[rank][meta.name] = _layout(meta, Box.whole(meta.shape), copy)
            continue
        for d in range(dp):
            for t in range(tp):
                out[base + d * tp + t][meta.name] = tp_layout(meta, t, tp, d)
    return out


def engine_layouts(metas: list[TensorMeta], replicas: int, tp: int, ep: bool
                   ) -> list[dict[str, TensorLayout]]:
    """R replicas of T workers (module docstring)."""
    experts = 1 + max((_expert_of(m.name) or 0) for m in metas)
    if ep and not any(_expert_of(m.name) is not None for m in metas):
        raise ConfigError("engine: 'ep' splits an MoE model's experts, and this model is "
                          "dense; drop 'ep' from --engine")
    if ep and experts % tp:
        raise ConfigError(f"engine: tp={tp} workers must divide the {experts} experts")
    out: list[dict[str, TensorLayout]] = [{} for _ in range(replicas * tp)]
    for meta in metas:
        expert = _expert_of(meta.name)
        for r in range(replicas):
            if expert is not None and ep:
                rank = expert // (experts // tp)
                out[r * tp + rank][meta.name] = _layout(meta, Box.whole(meta.shape), r)
                continue
            for t in range(tp):
                out[r * tp + t][meta.name] = tp_layout(meta, t, tp, r)
    return out


def _fields(spec: str) -> dict[str, int]:
    """``tp=8,pp=8,ep=32`` -> {"tp": 8, "pp": 8, "ep": 32}: known keys, each at least 1."""
    try:
        fields = {k: int(v) for k, v in (part.split("=") for part in spec.split(",") if part)}
    except ValueError:
        raise ConfigError(f"layout spec {spec!r}: expected key=number pairs, e.g. "
                          "tp=8,pp=8,ep=32") from None
    unknown = sorted(set(fields) - {"tp", "pp", "ep"})
    if unknown:
        raise ConfigError(f"layout spec {spec!r}: unknown key(s) {unknown}; use tp, pp, ep")
    small = sorted(k for k, v in fields.items() if v < 1)
    if small:
        raise ConfigError(f"layout spec {spec!r}: {', '.join(small)} must be >= 1")
    return fields


def trainer_layouts(metas: list[TensorMeta], spec: str, world: int
                    ) -> list[dict[str, TensorLayout]]:
    """Layouts of `world` trainer ranks from a spec: ``fsdp`` or ``megatron:tp=..,pp=..,ep=..``
    (`ConfigError` naming what is wrong)."""
    kind, _, rest = spec.partition(":")
    if kind == "fsdp" and rest:
        raise ConfigError(f"trainer layout {spec!r}: fsdp takes no options (every rank holds "
                          "a 1/N row shard); for tensor or pipeline parallelism use "
                          "megatron:tp=T,pp=P,ep=E")
    builders: dict[str, Callable[[], list[dict[str, TensorLayout]]]] = {
        "fsdp": lambda: fsdp_layouts(metas, world),
        "megatron": lambda: megatron_layouts(metas, world, **{
            k: v for k, v in {"tp": 1, "pp": 1, "ep": 1, **_fields(rest)}.items()}),
    }
    build = builders.get(kind)
    if build is None:
        raise ConfigError(f"trainer layout {spec!r}: choose fsdp or megatron:tp=T,pp=P,ep=E")
    try:
        return build()
    except TypeError as exc:
        raise ConfigError(f"trainer layout {spec!r}: {exc}") from None
