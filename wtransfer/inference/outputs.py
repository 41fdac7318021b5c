"""What the engine returns (torch-free), and its one plain-data form (`to_wire`/`from_wire`),
used by the HTTP server, the data-parallel sockets and the demo alike."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True, slots=True)
class WeightVersionSpan:
    """Output tokens [start, end) were produced by the weights labelled `version`."""

    version: str
    start: int
    end: int

    def to_wire(self) -> dict[str, Any]:
        """``{"version", "start", "end"}``."""
        return {"version": self.version, "start": self.start, "end": self.end}

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> WeightVersionSpan:
        """The inverse of `to_wire`."""
        return cls(str(data["version"]), int(data["start"]), int(data["end"]))


@dataclass(frozen=True)
class CompletionOutput:
    """One completion: tokens so far, their logprobs, why it ended, and weight versions."""

    index: int
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None
    """None while running; "length", "stop", "abort" or "error" at the end."""
    weight_versions: list[WeightVersionSpan] = field(default_factory=list)
    error: str | None = None
    """With finish_reason "error": what failed while computing this request."""
    prefilled_by: str = "local"
    """Where the prompt was prefilled: "local", or "remote" (a prefill instance's KV)."""

    def to_wire(self) -> dict[str, Any]:
        """The HTTP API's "choice" object (a logprob that is not finite as null: strict JSON)."""
        logprobs: list[float] | list[float | None] = (
            self.logprobs if all(map(math.isfinite, self.logprobs))
            else [lp if math.isfinite(lp) else None for lp in self.logprobs])
        out = {"index": self.index, "token_ids": self.token_ids, "logprobs": logprobs,
               "finish_reason": self.finish_reason,
               "weight_versions": [s.to_wire() for s in self.weight_versions],
               "prefilled_by": self.prefilled_by}
        if self.error is not None:
            out["error"] = self.error
        return out

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> CompletionOutput:
        """The inverse of `to_wire`."""
        return cls(int(data["index"]), list(data["token_ids"]),
                   [math.nan if lp is None else lp for lp in data["logprobs"]],
                   data["finish_reason"],
                   [WeightVersionSpan.from_wire(s) for s in data["weight_versions"]],
                   data.get("error"), str(data.get("prefilled_by", "local")))


@dataclass(frozen=True)
class RequestOutput:
    """The state of one request after an engine step (cumulative, not a delta)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool

    def to_wire(self) -> dict[str, Any]:
        """Plain data: the request id, prompt, finished flag and every choice."""
        return {"request_id": self.request_id, "prompt_token_ids": self.prompt_token_ids,
                "finished": self.finished, "outputs": [c.to_wire() for c in self.outputs]}

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> RequestOutput:
        """The inverse of `to_wire`."""
        return cls(str(data["request_id"]), list(data["prompt_token_ids"]),
                   [CompletionOutput.from_wire(c) for c in data["outputs"]],
                   bool(data["finished"]))

    @classmethod
    def ended(cls, request_id: str, prompt: list[int], reason: str,
              error: str | None = None) -> RequestOutput:
        """The final output of a request that ends with no (further) tokens: an abort, say,
        when its data-parallel rank died."""
        return cls(request_id, list(prompt), [CompletionOutput(0, [], [], reason, [], error)],
                   True)


class Generated(Protocol):
    """What an `OutputSnapshot` reads of a request (a `Sequence`): its lists only grow, and
    only the end of its last span moves."""

    request_id: str
    prompt: list[int]
    output: list[int]
    logprobs: list[float]
    spans: list[list[object]]


@dataclass(frozen=True)
class OutputSnapshot:
    """A request's cumulative output as of one step: a few fields the step records, built into a
    `RequestOutput` only when read (`build`, on the reader's thread). Safe to build while the
    engine goes on: the sequence's token lists only grow, and its spans are cut at `tokens`."""

    seq: Generated
    """The request's state, which only grows (a `Sequence`)."""
    tokens: int
    """Generated tokens at the snapshot."""
    finish_reason: str | None
    error: str | None
    prefilled_by: str
    finished: bool

    @property
    def request_id(self) -> str:
        """The request's id."""
        return self.seq.request_id

    def spans(self) -> list[WeightVersionSpan]:
        """The request's weight-version spans cut at the snapshot's tokens (the engine may
        have moved the last one's end since)."""
        n = self.tokens
        return [WeightVersionSpan(str(v), int(s), min(int(e), n))  # type: ignore[call-overload]
                for v, s, e in list(self.seq.spans) if int(s) < n]  # type: ignore[call-overload]

    def build(self) -> RequestOutput:
        """The `RequestOutput` of the snapshot."""
        seq, n = self.seq, self.tokens
        completion = CompletionOutput(0, seq.output[:n], seq.logprobs[:n], self.finish_reason,
                                      self.spans(), self.error, self.prefilled_by)
        return RequestOutput(seq.request_id, list(seq.prompt), [completion], self.finished)
