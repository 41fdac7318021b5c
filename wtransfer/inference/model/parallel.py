"""Tensor and expert parallelism of the engine's model: which slice of every tensor a worker
keeps, and the collectives its forward pass needs.

Rank r of N (Megatron-style, as vLLM shards Qwen3): q/k/v and gate/up are column-parallel
(rank r keeps its heads, its KV heads, its rows of the feed-forward width), o and down are
row-parallel (the matching columns; their outputs are summed by one all-reduce per block), the
embedding and the LM head are vocabulary-parallel (rank r keeps rows r*V/N .. (r+1)*V/N: an
embedding looks up its rows and an all-reduce sums; the LM head's logits are gathered), norms
and the MoE router are replicated. An MoE layer's experts are either split in width like the
dense feed-forward (each rank holds every expert's slice) or, with expert parallelism, split by
expert (rank r keeps experts r*E/N .. (r+1)*E/N whole). Tokens are never moved between ranks:
every rank holds every token's hidden state (the all-reduces keep them equal), computes the
contributions of the experts it holds for the tokens routed to them, and one all-reduce sums
the experts' outputs: the same collective as a dense block, at the price of each rank routing
every token (cheap: the router is one small matmul).

`layouts` gives each tensor's `wtransfer.records.TensorLayout` for one rank: what its
receiver keeps of a full tensor, and what the sharding-aware transfers will send it.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from wtransfer import wire
from wtransfer.errors import ConfigError, EngineDeadError
from wtransfer.inference.config import EngineConfig, ModelConfig
from wtransfer.packing import dtype_name, gather_records
from wtransfer.quant.fp8 import BLOCK, SCALE_SUFFIX
from wtransfer.records import Box, TensorLayout


def worker_device(config: EngineConfig, first_worker: int, rank: int) -> torch.device:
    """Where rank `rank` of the group whose first worker is `first_worker` runs:
    `device="cuda"` puts worker w on GPU w (modulo the GPUs present); an explicit device is
    used as given."""
    if config.device == "cuda" and torch.cuda.is_available():
        return torch.device("cuda", (first_worker + rank) % torch.cuda.device_count())
    return torch.device(config.device)


def collective_backend(config: EngineConfig, first_worker: int) -> str:
    """The process-group kind a tensor-parallel group moves its tensors with: "nccl" when
    every rank has a GPU of its own, else "gloo" (CPU, or ranks sharing a GPU, which NCCL
    refuses: gloo moves their CUDA tensors through the host)."""
    devices = [worker_device(config, first_worker, r)
               for r in range(config.tensor_parallel_size)]
    distinct = len({str(d) for d in devices}) == len(devices)
    return "nccl" if devices[0].type == "cuda" and distinct else "gloo"


class Collective:
    """The collectives of one tensor-parallel group, made through a store (no default process
    group): tensors over `backend` ("nccl" or "gloo", see `collective_backend`), records over gloo.
    A failure (a worker died) or a wait past the deadline is an `EngineDeadError`: no more steps."""

    def __init__(self, store: dist.Store, rank: int, size: int, timeout_s: float,
                 device: torch.device, backend: str = "gloo") -> None:
        self.rank, self.size, self.timeout_s = rank, size, timeout_s
        self.device = device
        wait = timedelta(seconds=timeout_s)
        self.control: Any = dist.ProcessGroupGloo(dist.PrefixStore("control/", store), rank,
                                                  size, wait)
        """Records and barriers (host tensors)."""
        if backend == "nccl":  # the CPU build of torch has no NCCL group
            nccl: Any = getattr(dist, "ProcessGroupNCCL")  # noqa: B009
            options = nccl.Options()
            options._timeout = wait
            self.pg: Any = nccl(dist.PrefixStore("data/", store), rank, size, options)
        else:
            self.pg = self.control

    def _run(self, what: str, work: Any) -> None:
        try:
            work.wait()
        except RuntimeError as exc:
            text = str(exc)
            if "imeout" in text or "imed out" in text:
                raise EngineDeadError(f"tensor-parallel {what} did not complete within "
                                      f"{self.timeout_s:g}s: a worker is stalled") from None
            raise EngineDeadError(f"tensor-parallel {what} failed (a worker died): "
                                  f"{text[:300]}") from None

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum over the group, in place."""
        self._run("all-reduce", self.pg.allreduce([tensor]))

    def barrier(self) -> None:
        """Return once every rank reached this point (and finished the work it queued on
        its device before it)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._run("barrier", self.control.allreduce([torch.zeros(1)]))

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `tensor` (same shape everywhere), in rank order (FP8 moves as its
        bytes: gloo has no float8 type)."""
        sent = tensor.contiguous()
        if sent.element_size() == 1 and sent.is_floating_point():
            return [p.view(sent.dtype) for p in self.all_gather(sent.view(torch.uint8))]
        parts = [torch.empty_like(sent) for _ in range(self.size)]
        self._run("all-gather", self.pg.allgather([parts], [sent]))
        return parts

    def broadcast(self, tensor: torch.Tensor, root: int = 0) -> None:
        """Rank `root`'s `tensor` on every rank, in place."""
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = root, 0
        group = self.control if tensor.device.type == "cpu" else self.pg
        self._run("broadcast", group.broadcast([tensor], opts))

    def all_gather_records(self, record: Any) -> list[Any]:
        """Every rank's plain-data `record`, in rank order (`packing.gather_records`)."""
        return gather_records(record, self._gather_control)

    def _gather_control(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        self._run("all-gather", self.control.allgather([parts], [tensor]))
        return parts

    def broadcast_record(self, record: Any) -> Any:
        """Rank 0's plain-data `record` on every rank (msgpack through byte tensors: no
        pickle); the others pass None."""
        data = wire.encode(record) if self.rank == 0 else b""
        size = torch.tensor([len(data)], dtype=torch.int64)
        self.broadcast(size)
        buffer = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if self.rank == 0
                  else torch.empty(int(size.item()), dtype=torch.uint8))
        if buffer.numel():
            self.broadcast(buffer)
        return wire.decode(buffer.numpy().tobytes())


@dataclass(frozen=True)
class Parallel:
    """This worker's place in its tensor-parallel group and the group's collectives."""

    rank: int = 0
    size: int = 1
    expert: bool = False
    """Whether an MoE layer's experts are split by expert (else by width)."""
    group: Collective | None = None
    """The collectives of the N workers (None when alone)."""

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the group, in place (alone: unchanged)."""
        if self.group is not None:
            self.group.all_reduce(tensor)
        return tensor

    def gather_last(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's `tensor` concatenated along the last dimension, in rank order."""
        if self.group is None:
            return tensor
        return torch.cat(self.group.all_gather(tensor), dim=-1)

    def span(self, total: int) -> tuple[int, int]:
        """This rank's [start, end) of `total` items split evenly (checked divisible)."""
        per = total // self.size
        return self.rank * per, (self.rank + 1) * per


ALONE = Parallel()
"""A model that is not split."""


def check_shardable(cfg: ModelConfig, par: Parallel) -> None:
    """`ConfigError` naming what does not split evenly over `par.size` workers."""
    if par.size == 1:
        return
    counts = {"num_attention_heads": cfg.num_attention_heads,
              "num_key_value_heads": cfg.num_key_value_heads,
              "intermediate_size": cfg.intermediate_size, "vocab_size": cfg.vocab_size}
    if cfg.num_experts:
        counts["num_experts" if par.expert else "moe_intermediate_size"] = (
            cfg.num_experts if par.expert else cfg.moe_intermediate_size)
    uneven = {k: v for k, v in counts.items() if v % par.size}
    if uneven:
        raise ConfigError(f"tensor_parallel_size={par.size} must divide {uneven} of the model")
    if par.expert and not cfg.num_experts:
        raise ConfigError("enable_expert_parallel needs an MoE model (num_experts > 0)")


def check_fp8_shardable(cfg: ModelConfig, size: int, *, expert: bool = False) -> None:
    """`ConfigError` unless each of `size` workers keeps whole 128 x 128 blocks of every FP8
    projection (its rows of q/k/v/gate/up, its columns of o/down; of every expert, with
    tensor-parallel experts, or whole experts with `expert` parallelism): then its scales
    are a slice of the full tensor's, and quantizing its part alone gives the same bytes."""
    if size == 1:
        return
    check_shardable(cfg, Parallel(0, size, expert))  # what does not divide at all, said so
    cuts = {"q_proj rows (heads x head_dim)": cfg.num_attention_heads // size * cfg.head_dim,
            "k_proj/v_proj rows (KV heads x head_dim)":
                cfg.num_key_value_heads // size * cfg.head_dim}
    if not all(cfg.is_moe_layer(layer) for layer in range(cfg.num_hidden_layers)):
        cuts["gate/up rows, down columns (intermediate_size)"] = cfg.intermediate_size // size
    if cfg.num_experts and not expert:
        cuts["expert gate/up rows, down columns (moe_intermediate_size)"] = (
            cfg.moe_intermediate_size // size)
    odd = {k: v for k, v in cuts.items() if v % BLOCK}
    if odd:
        raise ConfigError(f"quantization='fp8' with tensor_parallel_size={size} needs every "
                          f"worker's part of a projection to be whole {BLOCK}x{BLOCK} blocks; "
                          f"per worker: {odd} (not multiples of {BLOCK}); use fewer workers or "
                          "no quantization")


def _rows(name: str, dtype: str, shape: tuple[int, ...], dim: int, start: int, end: int
          ) -> TensorLayout:
    offsets = [0] * len(shape)
    lengths = list(shape)
    offsets[dim], lengths[dim] = start, end - start
    return TensorLayout(name=name, dtype=dtype, shape=shape,
                        boxes=(Box(offsets=tuple(offsets), lengths=tuple(lengths)),))


def layouts(cfg: ModelConfig, par: Parallel, full: dict[str, torch.Tensor]
            ) -> dict[str, TensorLayout]:
    """Each tensor of the full model (`full`: name -> tensor, as TP=1 holds it) as rank
    `par.rank` keeps it (see the module docstring)."""
    out: dict[str, TensorLayout] = {}
    hd = cfg.head_dim
    for name, tensor in full.items():
        shape, dtype = tuple(tensor.shape), dtype_name(tensor.dtype)
        if par.size == 1:
            out[name] = TensorLayout.whole(name, dtype, shape)
            continue
        leaf = name.rsplit(".", 2)
        kind = ".".join(leaf[-2:])
        if kind.endswith(SCALE_SUFFIX):
            continue  # after every weight: its scales follow its cut
        if kind == "q_proj.weight":
            a, b = par.span(cfg.num_attention_heads)
            out[name] = _rows(name, dtype, shape, 0, a * hd, b * hd)
        elif kind in ("k_proj.weight", "v_proj.weight"):
            a, b = par.span(cfg.num_key_value_heads)
            out[name] = _rows(name, dtype, shape, 0, a * hd, b * hd)
        elif kind == "o_proj.weight":
            a, b = par.span(cfg.num_attention_heads)
            out[name] = _rows(name, dtype, shape, 1, a * hd, b * hd)
        elif kind in ("gate_proj.weight", "up_proj.weight"):
            out[name] = _rows(name, dtype, shape, 0, *par.span(cfg.intermediate_size))
        elif kind == "down_proj.weight":
            out[name] = _rows(name, dtype, shape, 1, *par.span(cfg.intermediate_size))
        elif name.endswith(("embed_tokens.weight", "lm_head.weight")):
            out[name] = _rows(name, dtype, shape, 0, *par.span(cfg.vocab_size))
        elif name.endswith("experts.gate_up_proj"):  # [E, 2I, H]: gate rows, then up rows
            if par.expert:
                out[name] = _rows(name, dtype, shape, 0, *par.span(cfg.num_experts))
            else:
                inter = cfg.moe_intermediate_size
                a, b = par.span(inter)
                gate = _rows(name, dtype, shape, 1, a, b).boxes[0]
                up = _rows(name, dtype, shape, 1, inter + a, inter + b).boxes[0]
                out[name] = TensorLayout(name=name, dtype=dtype, shape=shape,
                                         boxes=(gate, up), concat_dim=1)
        elif name.endswith("experts.down_proj"):  # [E, H, I]
            out[name] = (_rows(name, dtype, shape, 0, *par.span(cfg.num_experts))
                         if par.expert else
                         _rows(name, dtype, shape, 2, *par.span(cfg.moe_intermediate_size)))
        else:  # norms, the router: every rank holds them whole
            out[name] = TensorLayout.whole(name, dtype, shape, replica=par.rank)
    for name, tensor in full.items():
        if par.size > 1 and name.endswith(SCALE_SUFFIX):
            out[name] = _scale_layout(name, tuple(tensor.shape), out[name.removesuffix(
                SCALE_SUFFIX)])
    return out


def _scale_layout(name: str, shape: tuple[int, ...], weight: TensorLayout) -> TensorLayout:
    """The block scales of an FP8 weight kept as `weight`: the same boxes, in 128-blocks on
    the last two dimensions (cuts at multiples of 128, which `check_fp8_shardable` makes
    sure of) and as they are on the others (the experts)."""
    if weight.is_whole:
        return TensorLayout.whole(name, "float32", shape, replica=weight.replica)
    matrix = len(shape) - 2
    boxes = []
    for box in weight.boxes:
        offsets, lengths = list(box.offsets), list(box.lengths)
        for d in range(matrix, len(shape)):
            offsets[d], lengths[d] = offsets[d] // BLOCK, -(-lengths[d] // BLOCK)
        boxes.append(Box(offsets=tuple(offsets), lengths=tuple(lengths)))
    return TensorLayout(name=name, dtype="float32", shape=shape, boxes=tuple(boxes),
                        concat_dim=weight.concat_dim)
