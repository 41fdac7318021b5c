"""What crosses the front end <-> rank sockets, as plain data for `wtransfer.wire` (msgpack).

Front end to rank: ``{"op": str, "id": int, "args": list}``. Rank to front end:
``{"kind": "reply", "id", "ok": true, "result"}``, a failed reply (``"kind"`` and ``"id"`` plus
the fields of `wtransfer.rpc.error_reply`), ``{"kind": "outputs", "outputs": [...]}``,
``{"kind": "wave", "wave": int}``, ``{"kind": "ready"}`` and ``{"kind": "fatal"}`` plus the
`error_reply` fields.
"""

from __future__ import annotations

from typing import Any

from wtransfer import errors
from wtransfer.inference.outputs import CompletionOutput, RequestOutput, WeightVersionSpan

_ERROR_TYPES: dict[str, type[errors.WTransferError]] = {
    cls.__name__: cls for cls in (errors.ConfigError, errors.LifecycleError,
                                  errors.MetadataError, errors.IntegrityError,
                                  errors.TransferTimeout)}


def output_to_wire(output: RequestOutput) -> dict[str, Any]:
    """A `RequestOutput` as plain data."""
    return {"request_id": output.request_id, "prompt_token_ids": output.prompt_token_ids,
            "finished": output.finished,
            "outputs": [{"index": c.index, "token_ids": c.token_ids, "logprobs": c.logprobs,
                         "finish_reason": c.finish_reason,
                         "weight_versions": [[s.version, s.start, s.end]
                                             for s in c.weight_versions]}
                        for c in output.outputs]}


def output_from_wire(data: dict[str, Any]) -> RequestOutput:
    """The inverse of `output_to_wire`."""
    completions = [CompletionOutput(c["index"], list(c["token_ids"]), list(c["logprobs"]),
                                    c["finish_reason"],
                                    [WeightVersionSpan(str(v), int(s), int(e))
                                     for v, s, e in c["weight_versions"]])
                   for c in data["outputs"]]
    return RequestOutput(data["request_id"], list(data["prompt_token_ids"]), completions,
                         bool(data["finished"]))


def aborted_output(request_id: str, prompt: list[int]) -> RequestOutput:
    """The final output of a request whose rank died: no tokens, finish_reason "abort"."""
    return RequestOutput(request_id, list(prompt), [CompletionOutput(0, [], [], "abort")], True)


def error_from_wire(rank: int, reply: dict[str, Any]) -> Exception:
    """The front end's exception for a rank's failed reply: the same wtransfer error type where
    there is one (so HTTP status codes stay right), else `PeerError` naming the remote type."""
    kind = str(reply.get("type", "Exception"))
    message = f"data-parallel rank {rank}: {reply.get('message', '')}"
    cls = _ERROR_TYPES.get(kind)
    if cls is not None:
        return cls(message)
    return errors.PeerError(f"{message} ({kind})", remote_type=kind)
