"""Runs the model over a scheduled batch against the paged KV cache, then samples."""

from __future__ import annotations

import logging
from collections.abc import Callable
from collections.abc import Sequence as Seq
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch

from wtransfer.errors import ConfigError
from wtransfer.inference.config import EngineConfig
from wtransfer.inference.model.attention import AttentionBatch, PagedDecode
from wtransfer.inference.model.decoder import Qwen3ForCausalLM
from wtransfer.inference.model.layer_kernels import paged_decode_for
from wtransfer.inference.model.lora_layers import LoRARows
from wtransfer.inference.params import SamplingParams
from wtransfer.inference.steps.decode_graphs import DecodeGraphs
from wtransfer.inference.steps.sequence import Sequence

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepPlan:
    """What one forward computes, as plain data (a tensor-parallel driver broadcasts it to its
    workers): the flat token ids, and per sequence its rows, the positions its new tokens take
    and its KV block table."""

    ids: list[int]
    segments: list[tuple[int, int, int, int, list[int]]]
    """(first row, end row, first new position, end position, block table) per sequence."""

    def to_wire(self) -> dict[str, Any]:
        """Plain form."""
        return {"ids": self.ids, "segments": [[*s[:4], s[4]] for s in self.segments]}

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> StepPlan:
        """Back from `to_wire` (from our own driver: trusted shapes)."""
        return cls(list(data["ids"]), [(int(a), int(b), int(c), int(d), list(t))
                                       for a, b, c, d, t in data["segments"]])


class ModelRunner:
    """Owns the KV cache tensors; `run(seqs)` computes each sequence's new tokens and returns
    one (token, logprob) per sequence. A tensor-parallel driver's runner hands each step's
    plan to `before_forward` (the workers compute the same plan on their shards)."""

    def __init__(self, model: Qwen3ForCausalLM, config: EngineConfig,
                 before_forward: Callable[[StepPlan], None] | None = None,
                 lora: tuple[LoRARows, Callable[[Sequence], int]] | None = None,
                 weights_epoch: Callable[[], int] = lambda: 0,
                 other_weights: Callable[[], AbstractContextManager[bool]] | None = None
                 ) -> None:
        self.model = model
        self.config = config
        self.before_forward = before_forward
        self.lora = lora
        """The model's adapter rows and each sequence's slot (None: no adapters)."""
        cfg = model.config
        param = next(model.parameters())
        slot = (cfg.num_key_value_heads // model.par.size, cfg.head_dim)
        self.num_blocks = kv_blocks(config, param.device, slot, param.dtype,
                                    cfg.num_hidden_layers)
        """KV blocks of the cache (`EngineConfig.num_kv_blocks`, or sized from free memory)."""
        # + a scratch block (decode graphs' padding rows) and a block nothing writes (zeros)
        shape = ((self.num_blocks + 2) * config.block_size, *slot)
        self.zero_slot = (self.num_blocks + 1) * config.block_size
        """A cache slot that stays zero: keys past a sequence's end read it."""
        self.kv = [(torch.zeros(shape, dtype=param.dtype, device=param.device),
                    torch.zeros(shape, dtype=param.dtype, device=param.device))
                   for _ in range(cfg.num_hidden_layers)]
        self.device = param.device
        kernels = (paged_decode_for(self.device, cfg.head_dim, param.dtype)
                   if config.paged_attention else None)
        self.paged_decode: PagedDecode | None = (kernels.paged_decode if kernels is not None
                                                 else None)
        """The kernel decode attention reads the paged cache in place with
        (`EngineConfig.paged_attention`, where it applies); None: the keys are gathered for
        SDPA."""
        self._generators: dict[str, torch.Generator] = {}
        self.graphs: DecodeGraphs | None = None
        """Decode steps as CUDA graphs (`EngineConfig.cuda_graphs`; None: every step eager)."""
        if (config.cuda_graphs and self.device.type == "cuda" and model.par.size == 1
                and lora is None and not cfg.num_experts):
            self.graphs = DecodeGraphs(model, self.kv, block_size=config.block_size,
                                       scratch_block=self.num_blocks,
                                       zero_slot=self.zero_slot,
                                       max_seqs=config.max_num_seqs,
                                       longest_context=min(cfg.max_position_embeddings, 8192),
                                       epoch=weights_epoch, paged=self.paged_decode,
                                       other_weights=other_weights)

    def slots_of(self, table: list[int], start: int, end: int) -> torch.Tensor:
        """Cache slots of positions [start, end) of a sequence whose block table is `table`."""
        bs = self.config.block_size
        positions = torch.arange(start, end, device=self.device)
        blocks = torch.tensor(table, dtype=torch.long, device=self.device)
        return blocks[positions // bs] * bs + positions % bs

    def plan(self, seqs: Seq[Sequence]) -> StepPlan:
        """The plan of one forward over `seqs` (each sequence's tokens not computed yet)."""
        ids: list[int] = []
        segments = []
        for seq in seqs:
            start, end = seq.num_computed, len(seq)
            row = len(ids)
            ids += seq.token_slice(start, end)
            segments.append((row, len(ids), start, end, list(seq.block_table)))
        return StepPlan(ids, segments)

    @torch.no_grad()
    def execute(self, plan: StepPlan) -> torch.Tensor:
        """Run one planned forward; the logits of each sequence's last row."""
        cfg = self.model.config
        batch = AttentionBatch.build(
            self.kv, plan.segments, block_size=self.config.block_size,
            gqa_group=cfg.num_attention_heads // cfg.num_key_value_heads,
            head_dim=cfg.head_dim, theta=cfg.rope_theta, zero_slot=self.zero_slot,
            device=self.device, paged=self.paged_decode)
        hidden = self.model(torch.tensor(plan.ids, dtype=torch.long, device=self.device), batch)
        last = torch.tensor([s[1] - 1 for s in plan.segments], device=self.device)
        return self.model.logits(hidden[last])

    def _forward(self, seqs: Seq[Sequence]) -> torch.Tensor:
        plan = self.plan(seqs)
        if self.before_forward is not None:
            self.before_forward(plan)
        if self.lora is not None:
            rows, slot_of = self.lora
            slots = [slot_of(seq) for seq in seqs]
            rows.rows = torch.tensor([slot for slot, (row, end, *_) in
                                      zip(slots, plan.segments, strict=True)
                                      for _ in range(row, end)], device=self.device)
            rows.used = sorted({s for s in slots if s >= 0})
            rows.uniform = slots[0] if slots[0] >= 0 and len(set(slots)) == 1 else None
        if self.graphs is not None and self.graphs.fits(plan.segments):
            logits = self.graphs.run(plan.segments, plan.ids)
            if logits is not None:
                return logits
        return self.execute(plan)

    def run(self, seqs: Seq[Sequence]) -> list[tuple[int, float] | None]:
        """Compute and sample; in batch-invariant mode each sequence runs alone. A sequence
        whose logits are not all finite gets None (nothing can be sampled from them), and
        the others are sampled as usual."""
        if self.config.batch_invariant:
            logits = torch.cat([self._forward([s]) for s in seqs])
        else:
            logits = self._forward(seqs)
        return self._sample_all(logits, seqs)

    def _sample_all(self, logits: torch.Tensor, seqs: Seq[Sequence]
                    ) -> list[tuple[int, float] | None]:
        """One (token, logprob) per row of `logits`, None where a row is not finite. Greedy
        rows are decided together, with one read back to the host; sampled rows one by one
        (each may have its own generator, top-k and top-p)."""
        greedy = logits.argmax(dim=-1)
        chosen = torch.log_softmax(logits, dim=-1).gather(1, greedy[:, None])[:, 0]
        finite = torch.isfinite(logits).all(dim=-1)
        tokens, logprobs, ok = torch.stack(
            [greedy.to(torch.float64), chosen.to(torch.float64),
             finite.to(torch.float64)]).tolist()
        out: list[tuple[int, float] | None] = []
        for i, seq in enumerate(seqs):
            if not ok[i]:
                out.append(None)
            elif seq.params.temperature == 0:
                out.append((int(tokens[i]), float(logprobs[i])))
            else:
                out.append(self._sample(logits[i], seq))
        return out

    def _sample(self, logits: torch.Tensor, seq: Sequence) -> tuple[int, float]:
        params: SamplingParams = seq.params
        scaled = logits / params.temperature
        logprobs = torch.log_softmax(scaled, -1)
        probs = _filter(logprobs.exp(), params.top_k, params.top_p)
        generator = None
        if params.seed is not None:
            generator = self._generators.get(seq.request_id)
            if generator is None:
                generator = torch.Generator(device=self.device).manual_seed(params.seed)
                self._generators[seq.request_id] = generator
        token = int(torch.multinomial(probs, 1, generator=generator))
        return token, float(logprobs[token])

    def release(self) -> None:
        """Drop the KV cache (the runner never runs again)."""
        self.kv = []
        self.graphs = None
        self._generators.clear()

    def forget(self, request_id: str) -> None:
        """Drop per-request sampling state of a finished request."""
        self._generators.pop(request_id, None)


def kv_blocks(config: EngineConfig, device: torch.device, slot_shape: tuple[int, int],
              dtype: torch.dtype, layers: int) -> int:
    """How many KV blocks to allocate: `num_kv_blocks`, or on CUDA with
    `kv_cache_memory_fraction` that fraction of the memory free now (the weights and the
    shadow are in place), said in the log."""
    fraction = config.kv_cache_memory_fraction
    if fraction is None or device.type != "cuda":
        return config.num_kv_blocks
    torch.cuda.empty_cache()  # (what the allocator caches counts as free here)
    free, total = torch.cuda.mem_get_info(device)
    per_block = (2 * layers * config.block_size * slot_shape[0] * slot_shape[1]
                 * torch.empty(0, dtype=dtype).element_size())
    blocks = int(free * fraction) // per_block
    if blocks < 1:
        raise ConfigError(f"no room for a KV cache on {device}: {free / 2**30:.2f} GiB free of "
                          f"{total / 2**30:.2f} GiB after the weights, one block needs "
                          f"{per_block / 2**20:.1f} MiB")
    log.info("KV cache on %s: %d blocks of %d tokens (%.2f GiB), %.2f of the %.2f GiB free "
             "after the weights and the shadow", device, blocks, config.block_size,
             blocks * per_block / 2**30, fraction, free / 2**30)
    return blocks


def _filter(probs: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    if top_k and top_k < probs.numel():
        kth = torch.topk(probs, top_k).values[-1]
        probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cumulative = torch.cumsum(sorted_probs, 0) / sorted_probs.sum()
        drop = cumulative - sorted_probs / sorted_probs.sum() >= top_p
        drop[0] = False  # the most likely token always stays, whatever rounding does
        sorted_probs[drop] = 0
        probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
    return probs
