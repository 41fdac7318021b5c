"""Continuous batching with pause states (torch-free).

Each step: running sequences decode first (FCFS); if a block is missing, the newest running
sequence is preempted (its blocks freed, recomputed later); then waiting sequences are
admitted (whole prefills, FCFS) while the token budget, `max_num_seqs` and free blocks allow.

Pause states: UNPAUSED schedules everything; PAUSED_NEW finishes running sequences but admits
nothing; PAUSED_ALL schedules nothing (token budget zero).
"""

from __future__ import annotations

import enum
from collections import deque

from wtransfer.errors import ConfigError
from wtransfer.inference.steps.block_manager import BlockManager
from wtransfer.inference.steps.sequence import SeqStatus, Sequence


class PauseState(enum.Enum):
    """What the scheduler may run."""

    UNPAUSED = "unpaused"
    PAUSED_NEW = "paused_new"
    PAUSED_ALL = "paused_all"


class Scheduler:
    """Decides which sequences compute how many tokens in the next step."""

    def __init__(self, blocks: BlockManager, *, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int) -> None:
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.budget = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.state = PauseState.UNPAUSED
        self.preemptions = 0

    def add(self, seq: Sequence) -> None:
        """Queue a new request; refuse one that could never run, saying how many tokens this
        prompt can have (the tightest of the model length, the KV cache and one step's token
        budget, which a re-prefill of prompt + tokens so far must fit)."""
        capacity = self.blocks.num_blocks * self.blocks.block_size
        limits = {"the model length": self.max_model_len,
                  "the KV cache (num_kv_blocks x block_size)": capacity,
                  "max_num_batched_tokens + 1 (a re-prefill must fit one step)":
                      self.budget + 1}
        tightest = min(limits, key=lambda k: limits[k])
        ceiling = limits[tightest] - len(seq.prompt)
        if seq.params.max_tokens > ceiling:
            room = (f"at most {ceiling} fit" if ceiling > 0
                    else "the prompt alone fills it")
            raise ConfigError(f"max_tokens={seq.params.max_tokens} is too many for this "
                              f"{len(seq.prompt)}-token prompt: {room}, bounded by {tightest} "
                              f"= {limits[tightest]} tokens")
        self.waiting.append(seq)

    def admit_prefilled(self, seq: Sequence) -> bool:
        """Run a sequence whose prompt's K/V is already in its blocks (a decode instance's
        remote prefill) at once, when new sequences are admitted and one more fits; False
        (nothing changed) otherwise."""
        if self.state is not PauseState.UNPAUSED or len(self.running) >= self.max_num_seqs:
            return False
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)
        return True

    def has_work(self) -> bool:
        """Whether a step would compute anything."""
        if self.state is PauseState.PAUSED_ALL:
            return False
        return bool(self.running) or (bool(self.waiting) and self.state is PauseState.UNPAUSED)

    def schedule(self) -> list[Sequence]:
        """The sequences of the next step; each computes its `num_new` tokens."""
        if self.state is PauseState.PAUSED_ALL:
            return []
        batch: list[Sequence] = []
        budget = self.budget
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            if not self._make_room(seq):
                break
            batch.append(seq)
            budget -= seq.num_new
            i += 1
        if self.state is PauseState.UNPAUSED:
            while self.waiting and len(self.running) < self.max_num_seqs:
                seq = self.waiting[0]
                if len(seq) > budget or not self.blocks.allocate(seq):
                    break
                self.waiting.popleft()
                seq.status = SeqStatus.RUNNING
                self.running.append(seq)
                batch.append(seq)
                budget -= seq.num_new
        return batch

    def _make_room(self, seq: Sequence) -> bool:
        while not self.blocks.grow(seq):
            victim = self.running[-1]
            self.preempt(victim)
            if victim is seq:
                return False
        return True

    def preempt(self, seq: Sequence) -> None:
        """Free a running sequence's blocks; it re-prefills (prompt + output) when readmitted."""
        self.blocks.free(seq)
        self.running.remove(seq)
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self.preemptions += 1

    def preempt_all(self) -> None:
        """Move every running sequence back to the front of the queue, in arrival order."""
        for seq in sorted(self.running, key=lambda s: s.arrival, reverse=True):
            self.preempt(seq)

    def finish(self, seq: Sequence, reason: str | None = None) -> None:
        """End a sequence (running or waiting) and release its blocks."""
        if reason is not None:
            seq.finish_reason = reason
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        self.blocks.free(seq)
        seq.status = SeqStatus.FINISHED
