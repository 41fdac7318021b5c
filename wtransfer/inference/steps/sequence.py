"""A request's state inside the engine (torch-free)."""

from __future__ import annotations

import enum
import itertools

from wtransfer.inference.outputs import OutputSnapshot, RequestOutput
from wtransfer.inference.params import SamplingParams

_arrivals = itertools.count()


class SeqStatus(enum.Enum):
    """Where a sequence is."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """Prompt, generated tokens, KV bookkeeping and weight-version spans of one request."""

    def __init__(self, request_id: str, prompt: list[int], params: SamplingParams) -> None:
        self.request_id = request_id
        self.prompt = list(prompt)
        self.params = params
        self.output: list[int] = []
        self.logprobs: list[float] = []
        self.spans: list[list[object]] = []  # [version, start, end]
        self.status = SeqStatus.WAITING
        self.finish_reason: str | None = None
        self.error: str | None = None
        """What failed, when finish_reason is "error"."""
        self.block_table: list[int] = []
        self.num_computed = 0
        """Tokens whose K/V are in the cache."""
        self.arrival = next(_arrivals)
        self.capture_kv = False
        """Keep the prompt's K/V when its first token is sampled (a prefill instance hands it
        over to a decode instance: `wtransfer.inference.serving.handover`)."""
        self.prefilled_by = "local"
        """Where the prompt's K/V was computed: "local", or "remote" (a prefill instance)."""
        self.published: tuple[int, int, int] | None = None
        """(prefix-cache epoch, full blocks published, hash of the last of them): where the
        block manager's `commit` goes on from (None: from the first block)."""

    @property
    def tokens(self) -> list[int]:
        """Prompt followed by the output so far."""
        return self.prompt + self.output

    def token_slice(self, start: int, end: int) -> list[int]:
        """`tokens[start:end]` without building the whole list (a decode step needs one)."""
        p = len(self.prompt)
        if start >= p:
            return self.output[start - p : end - p]
        return self.prompt[start:end] + self.output[: max(0, end - p)]

    def __len__(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def num_new(self) -> int:
        """Tokens to compute in the next step (all uncached ones)."""
        return len(self) - self.num_computed

    def append(self, token: int, logprob: float, version: str) -> None:
        """Record a sampled token and the weight version that produced it."""
        index = len(self.output)
        self.output.append(token)
        self.logprobs.append(logprob)
        if self.spans and self.spans[-1][0] == version and self.spans[-1][2] == index:
            self.spans[-1][2] = index + 1
        else:
            self.spans.append([version, index, index + 1])
        if token in self.params.stop_token_ids:
            self.finish_reason = "stop"
        elif len(self.output) >= self.params.max_tokens:
            self.finish_reason = "length"

    def to_output(self) -> RequestOutput:
        """The cumulative `RequestOutput`."""
        return self.snapshot().build()

    def snapshot(self) -> OutputSnapshot:
        """The output as of now, to build later (`OutputSnapshot`)."""
        return OutputSnapshot(self, len(self.output), self.finish_reason, self.error,
                              self.prefilled_by, self.status is SeqStatus.FINISHED)
