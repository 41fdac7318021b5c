"""Batched attention over the paged KV cache.

`AttentionBatch.build` lays out one step's tokens once (cache slots, rotary tables, padded
query and key indices, masks); every layer then attends with one kernel call per group: the
decoding sequences (one new token each) in one, the prefilling ones in another. No Python runs
per sequence on the hot path. On CUDA, where Triton is, a decode group reads the paged cache
in place (`wtransfer.inference.model.paged_decode`) instead of gathering its keys for SDPA.
docs/inference.md says how it is laid out and what it costs.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from wtransfer.inference.model.eager_ops import rotate_eager
from wtransfer.inference.model.layer_kernels import fused_for

SegmentSpec = tuple[int, int, int, int, list[int]]
"""One sequence in a step: (first row, end row, first new position, end position, block table)."""

PagedDecode = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                        int], torch.Tensor]
"""`wtransfer.inference.model.paged_decode.paged_decode`: (q, k_cache, v_cache, tables,
lengths, block_size) -> attention output."""

_CUDNN_OFF_LOCK = threading.Lock()
_cudnn_off_users = 0
_cudnn_was_on = False


@contextmanager
def without_cudnn_attention(device: torch.device) -> Iterator[None]:
    """Keep SDPA off cuDNN's kernel while a forward on CUDA runs (cuDNN plans every new shape, and
    prefill shapes are new nearly every step). The switch is process-wide: the first forward in
    turns cuDNN attention off where it was on, the last out turns it back on (docs/inference.md)."""
    global _cudnn_off_users, _cudnn_was_on
    if device.type != "cuda":
        yield
        return
    with _CUDNN_OFF_LOCK:
        if _cudnn_off_users == 0:
            _cudnn_was_on = torch.backends.cuda.cudnn_sdp_enabled()
            torch.backends.cuda.enable_cudnn_sdp(False)
        _cudnn_off_users += 1
    try:
        yield
    finally:
        with _CUDNN_OFF_LOCK:
            _cudnn_off_users -= 1
            if _cudnn_off_users == 0 and _cudnn_was_on:
                torch.backends.cuda.enable_cudnn_sdp(True)


@dataclass
class PagedLayout:
    """A decode group read in place from the paged cache by `kernel`, one query a sequence."""

    kernel: PagedDecode
    tables: torch.Tensor
    """[B, blocks] block table of each sequence."""
    lengths: torch.Tensor
    """[B] keys of each sequence (its position + 1)."""
    block_size: int
    """Cache slots per block."""


@dataclass
class AttentionGroup:
    """Sequences attended by one kernel call, padded to one query and one key length."""

    rows: torch.Tensor
    """[n] flat rows of the group's real queries, in the order of `take`."""
    query_rows: torch.Tensor
    """[B, Tq] flat row of each padded query (a pad repeats its sequence's last row)."""
    take: torch.Tensor | None
    """[n] index of each real query among the B * Tq padded ones (None: all of them, in flat
    row order: the group is the whole step, one row per sequence)."""
    context_slots: torch.Tensor | None
    """[B, Lk] cache slot of each key position (positions past a sequence's end are masked);
    None where the group decodes through the paged kernel."""
    mask: torch.Tensor | None
    """[B, 1, group * Tq, Lk] which keys each query sees, laid out for grouped-query attention
    (None: every key, one sequence decoding, or the paged kernel)."""
    paged: PagedLayout | None = None
    """Where the group decodes through the paged kernel (then nothing is gathered or masked),
    else None."""


@dataclass
class AttentionBatch:
    """The paged KV cache (one (K, V) pair of [slots, kv_heads, head_dim] per layer) and the
    layout of the tokens being computed, shared by every layer."""

    kv: Sequence[tuple[torch.Tensor, torch.Tensor]]
    slots: torch.Tensor
    """[N] cache slot each new token's K/V is written to."""
    cos: torch.Tensor
    """[N, 1, head_dim] float32 rotary cosines of the new tokens' positions."""
    sin: torch.Tensor
    """[N, 1, head_dim] float32 rotary sines."""
    groups: list[AttentionGroup]

    @classmethod
    def build(cls, kv: Sequence[tuple[torch.Tensor, torch.Tensor]],
              segments: Sequence[SegmentSpec], *, block_size: int, gqa_group: int,
              head_dim: int, theta: float, zero_slot: int, device: torch.device,
              paged: PagedDecode | None = None) -> AttentionBatch:
        """Lay out a step whose sequences are `segments` (rows in order, covering the batch);
        keys past a sequence's end read `zero_slot`, a cache slot nothing writes (a masked
        key still spreads a NaN it holds over its row). `paged`: the kernel the decoding
        sequences attend through (`layer_kernels.paged_decode_for` said it applies)."""
        tables = _padded([s[4] for s in segments], device)
        firsts = [s[0] for s in segments]
        lengths = [s[1] - s[0] for s in segments]
        positions = torch.tensor([p for s in segments for p in range(s[2], s[3])],
                                 dtype=torch.long, device=device)
        seq_of_row = torch.repeat_interleave(torch.arange(len(segments), device=device),
                                             torch.tensor(lengths, device=device),
                                             output_size=len(positions))
        slots = (tables[seq_of_row, positions // block_size] * block_size
                 + positions % block_size)
        cos, sin = rotary_tables(positions, head_dim, theta)
        decode = [i for i, n in enumerate(lengths) if n == 1]
        prefill = [i for i, n in enumerate(lengths) if n > 1]
        groups = []
        for members in (decode, prefill):
            if not members:
                continue
            whole = len(members) == len(segments)
            if paged is not None and members is decode:
                groups.append(_paged_group(paged, members, segments, firsts, tables,
                                           block_size, device, whole=whole))
            else:
                groups.append(_group(members, segments, firsts, lengths, tables, block_size,
                                     gqa_group, zero_slot, device, whole=whole))
        return cls(kv, slots, cos.unsqueeze(1), sin.unsqueeze(1), groups)


def _padded(tables: list[list[int]], device: torch.device) -> torch.Tensor:
    width = max(1, max(len(t) for t in tables))
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long,
                        device=device)


def _group(members: list[int], segments: Sequence[SegmentSpec], firsts: list[int],
           lengths: list[int], tables: torch.Tensor, block_size: int, gqa_group: int,
           zero_slot: int, device: torch.device, *, whole: bool) -> AttentionGroup:
    """The padded layout of the sequences `members` (indices into `segments`)."""
    n_seqs = len(members)
    tq = max(lengths[i] for i in members)
    lk = max(segments[i][3] for i in members)
    index = torch.tensor(members, dtype=torch.long, device=device)
    first = torch.tensor([firsts[i] for i in members], dtype=torch.long, device=device)
    length = torch.tensor([lengths[i] for i in members], dtype=torch.long, device=device)
    start = torch.tensor([segments[i][2] for i in members], dtype=torch.long, device=device)
    t = torch.arange(tq, device=device)
    last = torch.minimum(t[None, :], (length - 1)[:, None])
    query_rows = first[:, None] + last
    blocks = tables[index, : -(-lk // block_size)]
    context_slots = (blocks[:, :, None] * block_size
                     + torch.arange(block_size, device=device)).reshape(n_seqs, -1)[:, :lk]
    end = torch.tensor([segments[i][3] for i in members], dtype=torch.long, device=device)
    context_slots = torch.where(torch.arange(lk, device=device)[None, :] < end[:, None],
                                context_slots, zero_slot)
    mask = None
    if n_seqs > 1 or tq > 1:
        visible = torch.arange(lk, device=device)[None, None, :] <= (start[:, None]
                                                                     + last)[:, :, None]
        mask = visible[:, None, None].expand(n_seqs, 1, gqa_group, tq, lk).reshape(
            n_seqs, 1, gqa_group * tq, lk)
    if whole and tq == 1:
        return AttentionGroup(first, query_rows, None, context_slots, mask)
    rows = [firsts[i] + k for i in members for k in range(lengths[i])]
    take = [j * tq + k for j, i in enumerate(members) for k in range(lengths[i])]
    return AttentionGroup(torch.tensor(rows, dtype=torch.long, device=device), query_rows,
                          torch.tensor(take, dtype=torch.long, device=device), context_slots,
                          mask)


def _paged_group(kernel: PagedDecode, members: list[int], segments: Sequence[SegmentSpec],
                 firsts: list[int], tables: torch.Tensor, block_size: int,
                 device: torch.device, *, whole: bool) -> AttentionGroup:
    """The layout of decoding sequences `members` for the paged kernel: their rows, block
    tables and lengths; nothing gathered, nothing masked."""
    rows = torch.tensor([firsts[i] for i in members], dtype=torch.long, device=device)
    ends = torch.tensor([segments[i][3] for i in members], dtype=torch.long, device=device)
    chosen = tables if whole else tables[torch.tensor(members, device=device)]
    return AttentionGroup(rows, rows[:, None], None if whole else
                          torch.arange(len(members), device=device), None, None,
                          PagedLayout(kernel, chosen, ends, block_size))


_INVERSE: dict[tuple[int, float, torch.device], torch.Tensor] = {}


def rotary_tables(positions: torch.Tensor, head_dim: int, theta: float
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 cosines and sines [N, head_dim] of rotary embeddings at `positions`."""
    key = (head_dim, theta, positions.device)
    inverse = _INVERSE.get(key)
    if inverse is None:
        steps = torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32)
        inverse = _INVERSE[key] = 1.0 / (theta ** (steps / head_dim))
    freqs = positions.to(torch.float32)[:, None] * inverse[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Apply rotary embeddings to x [N, heads, head_dim] (computed in float32), through the
    fused kernel where it applies."""
    fused = fused_for(x)
    if (fused is not None and x.shape[-1] & (x.shape[-1] - 1) == 0 and cos.is_contiguous()
            and sin.is_contiguous() and cos.shape == sin.shape == (x.shape[0], 1, x.shape[-1])):
        return fused.rotate(x.contiguous(), cos, sin)
    return rotate_eager(x, cos, sin)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
           batch: AttentionBatch) -> torch.Tensor:
    """Write the new tokens' K/V into layer `layer`'s cache and attend every query to its
    sequence's keys; q [N, heads, D], k and v [N, kv_heads, D] (before rotary embeddings)."""
    n, heads, dim = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    q = rotate(q, batch.cos, batch.sin)
    k_cache, v_cache = batch.kv[layer]
    k_cache[batch.slots] = rotate(k, batch.cos, batch.sin)
    v_cache[batch.slots] = v
    out: torch.Tensor | None = None
    for g in batch.groups:
        n_seqs, tq = g.query_rows.shape
        if g.paged is not None:
            queries = q if g.take is None else q[g.rows]
            att = g.paged.kernel(queries, k_cache, v_cache, g.paged.tables, g.paged.lengths,
                                 g.paged.block_size)
            if g.take is None:
                return att
            if out is None:
                out = q.new_empty(n, heads, dim)
            out[g.rows] = att
            continue
        assert g.context_slots is not None
        queries = (q[g.query_rows].view(n_seqs, tq, kv_heads, group, dim)
                   .permute(0, 2, 3, 1, 4).reshape(n_seqs, kv_heads, group * tq, dim))
        keys = k_cache[g.context_slots].transpose(1, 2)
        values = v_cache[g.context_slots].transpose(1, 2)
        att = F.scaled_dot_product_attention(queries, keys, values, attn_mask=g.mask)
        att = (att.view(n_seqs, kv_heads, group, tq, dim).permute(0, 3, 1, 2, 4)
               .reshape(n_seqs * tq, heads, dim))
        if g.take is None:
            return att
        if out is None:
            out = q.new_empty(n, heads, dim)
        out[g.rows] = att[g.take]
    assert out is not None, "a step has at least one sequence"
    return out
