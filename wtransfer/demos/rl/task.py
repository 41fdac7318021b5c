"""The demo's verifiable task (torch-free).

"Chain parity": every generated token must lie in the lower half of the vocabulary when the
token just before it is even, and in the upper half when it is odd. A random policy scores
0.5; the reward is checkable exactly, and a tiny decoder can learn it in a few dozen steps.
"""

from __future__ import annotations

import random


class ChainParityTask:
    """Prompts and the verifiable reward of the demo."""

    def __init__(self, vocab_size: int, prompt_len: int = 4) -> None:
        self.vocab_size = vocab_size
        self.prompt_len = prompt_len

    def prompts(self, count: int, rng: random.Random) -> list[list[int]]:
        """`count` random prompts."""
        return [[rng.randrange(self.vocab_size) for _ in range(self.prompt_len)]
                for _ in range(count)]

    def reward(self, prompt: list[int], completion: list[int]) -> float:
        """Fraction of completion tokens in the half of the vocabulary their predecessor's
        parity asks for."""
        if not completion:
            return 0.0
        half = self.vocab_size // 2
        previous = [prompt[-1], *completion[:-1]]
        good = sum((token < half) == (prev % 2 == 0)
                   for token, prev in zip(completion, previous, strict=True))
        return good / len(completion)
