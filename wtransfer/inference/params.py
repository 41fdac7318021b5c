"""Sampling parameters of one request (torch-free)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from wtransfer.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How to pick each token. temperature 0 is greedy; logprobs of sampled tokens are always
    returned (under the temperature-scaled distribution, before top-k/top-p)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    """0 keeps every token."""
    seed: int | None = None
    """Per-request seed: the same request gives the same tokens whatever else is running."""
    stop_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ConfigError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ConfigError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ConfigError(f"top_k must be >= 0, got {self.top_k}")
        if any(t < 0 for t in self.stop_token_ids):
            raise ConfigError("stop_token_ids must be non-negative")
