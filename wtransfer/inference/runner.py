"""Runs the model over a scheduled batch against the paged KV cache, then samples."""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any

import torch

from wtransfer.inference.config import EngineConfig
from wtransfer.inference.lora import LoRARows
from wtransfer.inference.model import AttentionBatch, Qwen3ForCausalLM, Segment
from wtransfer.inference.params import SamplingParams
from wtransfer.inference.sequence import Sequence


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
                 lora: tuple[LoRARows, Callable[[Sequence], int]] | None = None) -> None:
        self.model = model
        self.config = config
        self.before_forward = before_forward
        self.lora = lora
        """The model's adapter rows and each sequence's slot (None: no adapters)."""
        cfg = model.config
        param = next(model.parameters())
        slots = config.num_kv_blocks * config.block_size
        shape = (slots, cfg.num_key_value_heads // model.par.size, cfg.head_dim)
        self.kv = [(torch.zeros(shape, dtype=param.dtype, device=param.device),
                    torch.zeros(shape, dtype=param.dtype, device=param.device))
                   for _ in range(cfg.num_hidden_layers)]
        self.device = param.device
        self._generators: dict[str, torch.Generator] = {}

    def _slots(self, table: list[int], start: int, end: int) -> torch.Tensor:
        bs = self.config.block_size
        return torch.tensor([table[p // bs] * bs + p % bs for p in range(start, end)],
                            dtype=torch.long, device=self.device)

    def plan(self, seqs: Seq[Sequence]) -> StepPlan:
        """The plan of one forward over `seqs` (each sequence's tokens not computed yet)."""
        ids: list[int] = []
        segments = []
        for seq in seqs:
            start, end = seq.num_computed, len(seq)
            row = len(ids)
            ids += seq.tokens[start:end]
            segments.append((row, len(ids), start, end, list(seq.block_table)))
        return StepPlan(ids, segments)

    @torch.no_grad()
    def execute(self, plan: StepPlan) -> torch.Tensor:
        """Run one planned forward; the logits of each sequence's last row."""
        segments = []
        for row, row_end, start, end, table in plan.segments:
            context = self._slots(table, 0, end)
            segments.append(Segment(row, row_end, context[start:end], context,
                                    torch.arange(start, end, device=self.device)))
        hidden = self.model(torch.tensor(plan.ids, dtype=torch.long, device=self.device),
                            AttentionBatch(self.kv, segments))
        return self.model.logits(hidden[[s[1] - 1 for s in plan.segments]])

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
        return self.execute(plan)

    def run(self, seqs: Seq[Sequence]) -> list[tuple[int, float] | None]:
        """Compute and sample; in batch-invariant mode each sequence runs alone. A sequence
        whose logits are not all finite gets None (nothing can be sampled from them), and
        the others are sampled as usual."""
        if self.config.batch_invariant:
            logits = torch.cat([self._forward([s]) for s in seqs])
        else:
            logits = self._forward(seqs)
        finite = torch.isfinite(logits).all(dim=-1).tolist()
        return [self._sample(row, seq) if ok else None
                for row, seq, ok in zip(logits, seqs, finite, strict=True)]

    def _sample(self, logits: torch.Tensor, seq: Sequence) -> tuple[int, float]:
        params: SamplingParams = seq.params
        if params.temperature == 0:
            token = int(torch.argmax(logits))
            return token, float(torch.log_softmax(logits, -1)[token])
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

    def forget(self, request_id: str) -> None:
        """Drop per-request sampling state of a finished request."""
        self._generators.pop(request_id, None)


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
