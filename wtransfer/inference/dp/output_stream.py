"""Outputs between a data-parallel rank and its front end, a step's new tokens at a time.

A rank's step emits each request's cumulative output; sent whole, every step would carry every
token so far (quadratic in the output's length, on the rank's loop and the front end's). A
rank sends what is new since its last message for the request (`RankOutputs.entry`); the front
end appends it to its own copy of the request and hands the engine's reader a snapshot of it
(`FrontEndOutputs.take`). Outputs a rank builds whole (an abort, an error) travel whole and
replace the front end's copy.
"""

from __future__ import annotations

from typing import Any

from wtransfer.inference.outputs import OutputSnapshot, RequestOutput
from wtransfer.inference.params import SamplingParams
from wtransfer.inference.steps.sequence import SeqStatus, Sequence


class RankOutputs:
    """A rank's side: how many tokens of each live request the front end has."""

    def __init__(self) -> None:
        self._sent: dict[str, int] = {}

    def entry(self, output: RequestOutput | OutputSnapshot) -> dict[str, Any]:
        """The wire entry for `output`: a snapshot's new tokens, or a whole output."""
        rid = output.request_id
        if not isinstance(output, OutputSnapshot):
            self._sent.pop(rid, None)
            return output.to_wire()
        seq, n = output.seq, output.tokens
        start = self._sent.pop(rid, 0)
        if not output.finished:
            self._sent[rid] = n
        return {"rid": rid, "from": start, **({"prompt": list(seq.prompt)} if not start else {}),
                "token_ids": seq.output[start:n],
                "logprobs": seq.logprobs[start:n],
                "spans": [[s.version, s.start, s.end] for s in output.spans()],
                "finish_reason": output.finish_reason, "error": output.error,
                "prefilled_by": output.prefilled_by, "finished": output.finished}


class FrontEndOutputs:
    """The front end's side: its copy of each live request's output."""

    def __init__(self) -> None:
        self._requests: dict[str, Sequence] = {}

    def take(self, data: dict[str, Any], prompt: list[int] | None
             ) -> RequestOutput | OutputSnapshot:
        """The output an entry from a rank stands for (`prompt`: the request's, if live)."""
        if "rid" not in data:  # a whole output
            output = RequestOutput.from_wire(data)
            self._requests.pop(output.request_id, None)
            return output
        rid = str(data["rid"])
        seq = self._requests.get(rid)
        if seq is None:
            seq = self._requests[rid] = Sequence(
                rid, [int(t) for t in data.get("prompt", prompt or [])], SamplingParams())
        if int(data["from"]) != len(seq.output):
            raise ValueError(f"request {rid!r}: a rank sent tokens from {data['from']}, the "
                             f"front end holds {len(seq.output)}")
        seq.output.extend(int(t) for t in data["token_ids"])
        seq.logprobs.extend(float(lp) for lp in data["logprobs"])
        seq.spans = [[str(v), int(s), int(e)] for v, s, e in data["spans"]]
        seq.prefilled_by = str(data["prefilled_by"])
        finished = bool(data["finished"])
        if finished:
            seq.status = SeqStatus.FINISHED
            self._requests.pop(rid, None)
        return OutputSnapshot(seq, len(seq.output), data["finish_reason"], data["error"],
                              str(data["prefilled_by"]), finished)

    def end(self, request_id: str, prompt: list[int], error: str) -> RequestOutput:
        """The final output of a request that ends without its rank's word (the rank died):
        every token the front end holds, finish_reason "error" with `error`."""
        seq = self._requests.pop(request_id, None)
        if seq is None:
            return RequestOutput.ended(request_id, prompt, "error", error)
        return OutputSnapshot(seq, len(seq.output), "error", error, seq.prefilled_by,
                              True).build()
