"""Paged KV-cache blocks with prefix caching (torch-free).

A block holds `block_size` token positions. Full blocks are named by a hash chained over the
tokens of every block before them, so two sequences with the same prefix share the same
blocks. Freed blocks keep their hash and stay reusable until they are handed out again (least
recently freed first).
"""

from __future__ import annotations

from collections import OrderedDict

from wtransfer.inference.steps.sequence import Sequence


class BlockManager:
    """Allocation, reference counts and the prefix cache of the KV blocks."""

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self._ref = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self._hash_of: dict[int, int] = {}
        self._block_of: dict[int, int] = {}
        self._epoch = 0
        """Bumped when the prefix cache is forgotten (what sequences published is gone)."""
        self.hits = 0
        """Blocks reused from the prefix cache since start (a counter for metrics and tests)."""

    @property
    def num_free(self) -> int:
        """Blocks not referenced by any sequence."""
        return len(self._free)

    def _chain(self, tokens: list[int], count: int) -> list[int]:
        hashes, prev = [], 0
        for i in range(count):
            prev = hash((prev, tuple(tokens[i * self.block_size : (i + 1) * self.block_size])))
            hashes.append(prev)
        return hashes

    def _take(self) -> int:
        block, _ = self._free.popitem(last=False)
        old = self._hash_of.pop(block, None)
        if old is not None and self._block_of.get(old) == block:
            del self._block_of[old]
        self._ref[block] = 1
        return block

    def allocate(self, seq: Sequence) -> bool:
        """Give a waiting sequence blocks for all its tokens, reusing cached prefix blocks.
        Returns False (allocating nothing) when too few blocks are free."""
        tokens = seq.tokens
        total = -(-len(tokens) // self.block_size)
        hits: list[int] = []
        if self.prefix_caching:
            for h in self._chain(tokens, len(tokens) // self.block_size):
                block = self._block_of.get(h)
                if block is None:
                    break
                hits.append(block)
            if len(hits) * self.block_size >= len(tokens):
                hits.pop()  # the last token must be computed to get logits
        reclaimed = sum(1 for b in hits if self._ref[b] == 0)
        if total - len(hits) > len(self._free) - reclaimed:
            return False
        for block in hits:
            if self._ref[block] == 0:
                del self._free[block]
            self._ref[block] += 1
        self.hits += len(hits)
        seq.block_table = hits + [self._take() for _ in range(total - len(hits))]
        seq.num_computed = len(hits) * self.block_size
        return True

    def grow(self, seq: Sequence) -> bool:
        """Make room for every token of a running sequence; False when no block is free."""
        need = -(-len(seq) // self.block_size) - len(seq.block_table)
        if need > len(self._free):
            return False
        seq.block_table += [self._take() for _ in range(need)]
        return True

    def commit(self, seq: Sequence) -> None:
        """Publish the sequence's computed full blocks in the prefix cache (those it did not
        publish yet: a decode step hashes at most one new block, not the whole chain)."""
        if not self.prefix_caching:
            return
        size = self.block_size
        full = seq.num_computed // size
        done, prev = 0, 0
        if seq.published is not None and seq.published[0] == self._epoch \
                and seq.published[1] <= full:
            _, done, prev = seq.published
        for i in range(done, full):
            prev = hash((prev, tuple(seq.token_slice(i * size, (i + 1) * size))))
            block = seq.block_table[i]
            if prev not in self._block_of and block not in self._hash_of:
                self._block_of[prev] = block
                self._hash_of[block] = prev
        seq.published = (self._epoch, full, prev)

    def free(self, seq: Sequence) -> None:
        """Release the sequence's blocks (cached ones stay reusable until handed out)."""
        for block in reversed(seq.block_table):
            self._ref[block] -= 1
            if self._ref[block] == 0:
                self._free[block] = None
        seq.block_table = []
        seq.num_computed = 0
        seq.published = None

    def reset_prefix_cache(self) -> None:
        """Forget every cached block hash; blocks in use stay with their sequences."""
        self._hash_of.clear()
        self._block_of.clear()
        self._epoch += 1
