"""Sampling parameters of one request (torch-free), validated at admission."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from wtransfer.errors import ConfigError

MIN_TEMPERATURE = 1e-5
"""Smallest non-zero temperature: below it, logits / temperature overflows float32."""
MAX_TOKENS = (1 << 31) - 1
"""A sanity bound only: an engine refuses what its model length, KV cache and step budget
cannot hold, naming the real ceiling for the prompt (`Scheduler.add`)."""
MAX_STOP_TOKENS = 1024
SEED_RANGE = (-(1 << 63), (1 << 64) - 1)
"""What a torch generator accepts as a seed."""


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How to pick each token. temperature 0 is greedy; logprobs of sampled tokens are always
    returned (temperature-scaled, before top-k/top-p). Every field is range-checked here: a bad
    value is a `ConfigError` (HTTP 400) naming the field and its allowed range."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    """0 keeps every token."""
    seed: int | None = None
    """Per-request seed: the same request gives the same tokens whatever else is running."""
    stop_token_ids: list[int] = field(default_factory=list)
    lora: str | None = None
    """The LoRA adapter to generate with (by the name it was loaded under); None: the base
    model."""

    def __post_init__(self) -> None:
        if not 1 <= self.max_tokens <= MAX_TOKENS:
            raise ConfigError(f"sampling_params.max_tokens must be in [1, {MAX_TOKENS}], "
                              f"got {self.max_tokens}")
        if not (math.isfinite(self.temperature) and
                (self.temperature == 0 or MIN_TEMPERATURE <= self.temperature <= 1e6)):
            raise ConfigError(f"sampling_params.temperature must be 0 (greedy) or in "
                              f"[{MIN_TEMPERATURE:g}, 1e6], got {self.temperature!r}")
        if not (math.isfinite(self.top_p) and 0 < self.top_p <= 1):
            raise ConfigError(f"sampling_params.top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_k < 0:
            raise ConfigError(f"sampling_params.top_k must be >= 0 (0: no limit), "
                              f"got {self.top_k}")
        low, high = SEED_RANGE
        if self.seed is not None and not low <= self.seed <= high:
            raise ConfigError(f"sampling_params.seed must be in [-2**63, 2**64 - 1], "
                              f"got {self.seed}")
        if len(self.stop_token_ids) > MAX_STOP_TOKENS:
            raise ConfigError(f"sampling_params.stop_token_ids holds at most "
                              f"{MAX_STOP_TOKENS} ids, got {len(self.stop_token_ids)}")
        if any(t < 0 for t in self.stop_token_ids):
            raise ConfigError("sampling_params.stop_token_ids must be non-negative")
        if self.lora is not None and not (0 < len(self.lora) <= 64):
            raise ConfigError(f"sampling_params.lora must name an adapter, got {self.lora!r:.80}")
