"""Decode steps replayed as CUDA graphs.

A decode-only step (every sequence computes one token) of a dense model on one CUDA device is
the same few thousand kernel launches every time; `DecodeGraphs` captures it once per
(batch-size bucket, context-length bucket) with static inputs and replays it. Padding rows
compute a dummy token against a scratch KV slot no sequence owns; padding keys are masked.

A graph holds the addresses of the weights it read. A staged `swap` commit (and a rollback)
exchanges weight storages, so the runner's `epoch` moves: the graphs are then looked up by the
addresses the weights now have. A swap alternates between two sets of storages; given
`other_weights` (the shadow put in place for a while), each bucket is captured for both sets
when first used, so a commit replays graphs captured before it. Sets are kept by address
(`KEPT_SETS`); any other set captures its own on next use. In-place updates and `copy` commits
keep the addresses. docs/inference.md says what each costs.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch

from wtransfer.inference.model.attention import (
    AttentionBatch,
    AttentionGroup,
    PagedDecode,
    PagedLayout,
    rotary_tables,
)
from wtransfer.inference.model.decoder import Qwen3ForCausalLM
from wtransfer.transport.capture_lock import CAPTURING

log = logging.getLogger(__name__)

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
"""Batch sizes a graph is captured for (a step runs in the smallest that holds it)."""
SHORTEST_CONTEXT = 256
"""The smallest context bucket; buckets double from it up to `longest_context`."""
KEPT_SETS = 2
"""Sets of graphs kept, each for one set of weight addresses (a swap's live and shadow)."""


_CAPTURE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}
_STREAMS_LOCK = threading.Lock()


def capture_stream(device: torch.device) -> torch.cuda.Stream:
    """The process's one side stream for decode-graph warm-ups and captures on `device`:
    cuBLAS keeps a workspace per stream (32 MiB on an H100) that captured graphs refer to, so
    engines created one after another share one instead of leaving one each."""
    with _STREAMS_LOCK:
        if device not in _CAPTURE_STREAMS:
            _CAPTURE_STREAMS[device] = torch.cuda.Stream(device)
        return _CAPTURE_STREAMS[device]


@dataclass
class _Graph:
    """One captured decode forward and its static inputs and output."""

    host: torch.Tensor
    """[B * (3 + blocks)] int64 staging of the inputs on the host (pinned on CUDA)."""
    inputs: torch.Tensor
    """The same on the device; the views below are slices of it."""
    ids: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    tables: torch.Tensor
    """[B, blocks] block table of each row (blocks * block_size = the context bucket)."""
    logits: torch.Tensor
    """[B, vocab] float32 output."""
    graph: torch.cuda.CUDAGraph | None
    """None: replayed eagerly from the static inputs (on the host: tests of the layout)."""
    copied: torch.cuda.Event | None = None
    """Recorded after the last copy of `host` to the device (CUDA): `host` is written again
    only once it has passed."""


class DecodeGraphs:
    """Captured decode forwards of `model` over the cache `kv` (see the module docstring)."""

    def __init__(self, model: Qwen3ForCausalLM, kv: Sequence[tuple[torch.Tensor, torch.Tensor]],
                 *, block_size: int, scratch_block: int, zero_slot: int, max_seqs: int,
                 longest_context: int,
                 epoch: Callable[[], int], capture: bool = True,
                 paged: PagedDecode | None = None,
                 other_weights: Callable[[], AbstractContextManager[bool]] | None = None
                 ) -> None:
        self.model = model
        self.kv = kv
        self.block_size = block_size
        self.scratch_block = scratch_block
        """A KV block no sequence owns: padding rows write and read it."""
        self.zero_slot = zero_slot
        """A KV slot nothing writes (zeros): keys past a sequence's end read it, so stale
        values of a block's earlier owner (NaN included) never reach a masked-out score."""
        self.batch_buckets = [b for b in BATCH_BUCKETS if b < max_seqs] + [max_seqs]
        self.longest_context = longest_context
        self.epoch = epoch
        self.capture = capture
        self.paged = paged
        """The kernel decode attention reads each sequence's keys with, up to its length;
        None: they are gathered for SDPA up to the context bucket."""
        self.other_weights = other_weights
        """Puts the storages the weights will have after the next swap commit in place for
        a while, yielding whether it did (None: no swap staging; any new address set
        captures its graphs when first used)."""
        self._pending: set[tuple[int, int]] = set()
        """Buckets not yet captured for the other address set (the weights were being read
        when they were captured for the present one)."""
        self.device = next(model.parameters()).device
        self._graphs: dict[tuple[int, int], _Graph] = {}
        """The graphs of the weights' present addresses, by (batch, context) bucket."""
        self._sets: OrderedDict[tuple[int, ...], dict[tuple[int, int], _Graph]] = OrderedDict()
        """Graph sets by the weights' addresses, the present one last."""
        self._present = self._addresses()
        """The weights' addresses now: the key of `_graphs` in `_sets`."""
        self._sets[self._present] = self._graphs
        self._epoch = epoch()
        self._pool = torch.cuda.graph_pool_handle() if capture else None
        self._stream = capture_stream(self.device) if capture else None
        """The side stream warm-ups and captures run on (not the device's default stream)."""
        self._logits = torch.zeros(self.batch_buckets[-1], model.config.vocab_size,
                                   dtype=torch.float32, device=self.device)
        """The output of every graph (one replay at a time), sliced to its batch."""
        self.built = 0
        """Graphs built (captured on CUDA) since start; a swap commit to weight addresses
        without a kept set makes the next decode steps build theirs."""
        self.disabled: str | None = None
        """Why graphs are off for good (a capture failed), else None."""

    def fits(self, segments: Sequence[tuple[int, int, int, int, list[int]]]) -> bool:
        """Whether a step of `segments` can replay a graph: decode only, within the buckets."""
        return (self.disabled is None and len(segments) <= self.batch_buckets[-1]
                and all(s[1] - s[0] == 1 for s in segments)
                and max(s[3] for s in segments) <= self.longest_context)

    def run(self, segments: Sequence[tuple[int, int, int, int, list[int]]],
            ids: Sequence[int]) -> torch.Tensor | None:
        """The logits [len(segments), vocab] of a decode step (`fits` said yes); None when
        capturing failed (graphs are then off for good: the step runs eagerly)."""
        if self.device.type != "cuda":
            return self._run(segments, ids)
        with torch.cuda.device(self.device):  # (the engine thread's current device may differ)
            return self._run(segments, ids)

    def _run(self, segments: Sequence[tuple[int, int, int, int, list[int]]],
             ids: Sequence[int]) -> torch.Tensor | None:
        if self.epoch() != self._epoch:  # the weights moved: the graphs of where they are now
            self._epoch = self.epoch()
            self._present = self._addresses()
            self._graphs = self._sets.setdefault(self._present, {})
            self._keep_present_last()
        batch = next(b for b in self.batch_buckets if b >= len(segments))
        context = SHORTEST_CONTEXT
        while context < max(s[3] for s in segments):
            context *= 2
        graph = self._graphs.get((batch, context))
        if graph is None or self._pending:
            try:
                if graph is None:
                    graph = self._new(batch, context)
                    self._graphs[(batch, context)] = graph
                    self._pending.add((batch, context))
                self._new_for_other_weights()
            except Exception as exc:  # (a kernel that cannot be captured: run eagerly)
                self.disabled = f"{type(exc).__name__}: {exc}"
                log.warning("CUDA graphs are off for this engine, every step runs eagerly: "
                            "capturing a decode step failed: %s", self.disabled)
                self._sets.clear()  # (every set: graphs are off for good)
                self._graphs = {}
                self._pending.clear()
                return None
        self._fill(graph, segments, ids)
        if graph.graph is not None:
            graph.graph.replay()
        else:
            self._forward(graph)
        return graph.logits[: len(segments)].clone()  # the next replay overwrites them

    def _new_for_other_weights(self) -> None:
        """Capture the pending buckets for where the weights will be after a swap commit
        too, so the steps after it replay instead of capturing (left pending while the
        weights are being read: `StagedWeights.lock`)."""
        if self.other_weights is None:
            self._pending.clear()
            return
        with self.other_weights() as placed:
            if not placed:
                return
            graphs = self._sets.setdefault(self._addresses(), {})
            for bucket in sorted(self._pending):
                if bucket not in graphs:
                    graphs[bucket] = self._new(*bucket)
            self._pending.clear()
        self._keep_present_last()

    def _keep_present_last(self) -> None:
        """The present set last, and no more than `KEPT_SETS` sets (the oldest go)."""
        self._sets.move_to_end(self._present)
        while len(self._sets) > KEPT_SETS:
            self._sets.popitem(last=False)

    def _fill(self, graph: _Graph, segments: Sequence[tuple[int, int, int, int, list[int]]],
              ids: Sequence[int]) -> None:
        """Write a step's inputs (padding rows point at the scratch block) into the graph's."""
        rows, blocks = graph.tables.shape
        bs, scratch, pad = self.block_size, self.scratch_block, rows - len(segments)
        positions = [s[3] - 1 for s in segments]
        slots = [s[4][p // bs] * bs + p % bs for s, p in zip(segments, positions, strict=True)]
        flat = [*ids, *[0] * pad, *positions, *[0] * pad, *slots, *[scratch * bs] * pad]
        for s in segments:
            table = s[4][:blocks]
            flat += table + [0] * (blocks - len(table))
        flat += ([scratch] + [0] * (blocks - 1)) * pad
        if graph.copied is not None:
            graph.copied.synchronize()  # (a step that reads nothing back replays again soon)
        graph.host.copy_(torch.tensor(flat, dtype=torch.long))
        graph.inputs.copy_(graph.host, non_blocking=True)
        if graph.copied is not None:
            graph.copied.record(torch.cuda.current_stream(self.device))

    def _addresses(self) -> tuple[int, ...]:
        """Where every tensor of the model's state lies (what a captured graph reads, and
        what a staged commit exchanges), each alias once."""
        state = {id(t): t for t in self.model.state_dict(keep_vars=True).values()}
        return tuple(t.data_ptr() for t in state.values())

    def _new(self, batch: int, context: int) -> _Graph:
        """Static buffers for a (batch, context) bucket, captured unless on the host."""
        blocks = -(-context // self.block_size)
        size = batch * (3 + blocks)
        host = torch.zeros(size, dtype=torch.long, pin_memory=self.device.type == "cuda")
        inputs = torch.zeros(size, dtype=torch.long, device=self.device)
        graph = _Graph(host, inputs, inputs[:batch], inputs[batch : 2 * batch],
                       inputs[2 * batch : 3 * batch], inputs[3 * batch :].view(batch, blocks),
                       self._logits[:batch], None)
        host[2 * batch : 3 * batch] = self.scratch_block * self.block_size
        host[3 * batch :].view(batch, blocks)[:, 0] = self.scratch_block
        inputs.copy_(host)
        self.built += 1
        if not self.capture:
            return graph
        graph.copied = torch.cuda.Event()
        stream, current = self._stream, torch.cuda.current_stream(self.device)
        assert stream is not None
        with CAPTURING:  # (engines of one process share the stream; copy graphs capture too)
            self._capture(graph, stream, current)
        log.debug("captured a decode graph: batch %d, context %d", batch, context)
        return graph

    def _capture(self, graph: _Graph, stream: torch.cuda.Stream,
                 current: torch.cuda.Stream) -> None:
        stream.wait_stream(current)
        try:
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm up: kernels chosen, lazy state built, uncaptured
                    self._forward(graph)
            current.wait_stream(stream)
            graph.graph = torch.cuda.CUDAGraph()
            # thread_local: the transfer lane may write a shadow on its own thread meanwhile
            with torch.cuda.graph(graph.graph, pool=self._pool, stream=stream,
                                  capture_error_mode="thread_local"):
                self._forward(graph)
        finally:  # (a capture that failed may not have put the engine's stream back)
            torch.cuda.set_stream(current)

    @torch.no_grad()
    def _forward(self, graph: _Graph) -> None:
        """The decode forward from the static inputs into the static logits."""
        cfg = self.model.config
        batch, blocks = graph.tables.shape
        cos, sin = rotary_tables(graph.positions, cfg.head_dim, cfg.rope_theta)
        rows = torch.arange(batch, device=self.device)
        if self.paged is not None:
            attention = AttentionGroup(rows, rows[:, None], None, None, None, PagedLayout(
                self.paged, graph.tables, graph.positions + 1, self.block_size))
        else:
            context = blocks * self.block_size
            group = cfg.num_attention_heads // cfg.num_key_value_heads
            offsets = torch.arange(self.block_size, device=self.device)
            context_slots = (graph.tables[:, :, None] * self.block_size + offsets).reshape(
                batch, blocks * self.block_size)[:, :context]
            keys = torch.arange(context, device=self.device)
            visible = keys[None, :] <= graph.positions[:, None]
            context_slots = torch.where(visible, context_slots, self.zero_slot)
            mask = visible[:, None, None, :].expand(batch, 1, group, context)
            attention = AttentionGroup(rows, rows[:, None], None, context_slots, mask)
        layout = AttentionBatch(self.kv, graph.slots, cos.unsqueeze(1), sin.unsqueeze(1),
                                [attention])
        graph.logits.copy_(self.model.logits(self.model(graph.ids, layout)))
