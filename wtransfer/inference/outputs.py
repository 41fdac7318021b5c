"""What the engine returns (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class WeightVersionSpan:
    """Output tokens [start, end) were produced by the weights labelled `version`."""

    version: str
    start: int
    end: int


@dataclass(frozen=True)
class CompletionOutput:
    """One completion: tokens so far, their logprobs, why it ended, and weight versions."""

    index: int
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None
    """None while running; "length", "stop" or "abort" at the end."""
    weight_versions: list[WeightVersionSpan] = field(default_factory=list)


@dataclass(frozen=True)
class RequestOutput:
    """The state of one request after an engine step (cumulative, not a delta)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
