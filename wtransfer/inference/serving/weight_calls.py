"""``POST /weight_calls``: several weight-sync calls in one request.

A sender's update is a short sequence of calls (start, update calls, finish). Each alone
costs a request's round trip and its parsing; `wtransfer.protocol.CallQueue` sends the calls
that wait together as one batch instead (a lone sender's whole update, usually). Each call
carries its own route's body (msgpack), checked as that route checks it. The server checks
the whole batch before any call runs (a 400 names the bad call), runs the calls in order,
each only if the earlier call it names as `after` succeeded (`commands.chained`), and
streams each call's `CallOutcome` as one JSON line the moment it is known, so a sender
reuses a bucket's staging slot as soon as that bucket's call is answered. The same route
serves a decode instance's K/V hand-over under ``/kv``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Collection
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from wtransfer import wire
from wtransfer.errors import ConfigError, MetadataError, WTransferError, error_kind
from wtransfer.inference.commands import Chained
from wtransfer.inference.serving.http_body import check_fields, field, status_of
from wtransfer.records import BATCHED_CALLS, MAX_BATCHED_CALLS, CallOutcome, WeightCall
from wtransfer.wire import parse_record, record_to_wire

log = logging.getLogger("wtransfer.server")

MAX_MESSAGE_CHARS = 64 << 10
"""Longest error message an answer line carries (the rest is cut, marked)."""

RunCalls = Callable[[list[Chained]], AsyncGenerator[BaseException | None, None]]
"""Runs a checked batch in order; yields each call's failure (None: it succeeded)."""
BodyOf = Callable[[Request, tuple[str, ...]], Awaitable[dict[str, Any]]]


def prepared(call: WeightCall, limit: int) -> Chained:
    """`call` as an engine command, its body checked as its own route checks it."""
    body = wire.decode(call.body, max_bytes=limit) if call.body else {}
    args = check_fields(body, BATCHED_CALLS[call.method])
    if call.method == "update_weights":
        return call.method, (field(args, "update_info", dict),), call.after
    if call.method == "finish_weight_update":
        return call.method, (field(args, "weight_version", str, None),), call.after
    if call.method == "discard_weight_update":
        return call.method, (field(args, "reason", str, "discarded"),), call.after
    return call.method, (), call.after


def parse_calls(items: list[Any], methods: Collection[str], limit: int) -> list[Chained]:
    """Every call of a batch, checked before any runs (`methods`: those this route serves)."""
    if not 0 < len(items) <= MAX_BATCHED_CALLS:
        raise ConfigError(f"calls must hold 1 to {MAX_BATCHED_CALLS} calls, got {len(items)}")
    commands = []
    for index, item in enumerate(items):
        call = parse_record(WeightCall, item, where=f"calls[{index}]")
        if call.method not in methods:
            raise ConfigError(f"calls[{index}]: {call.method} is not served here; this route "
                              f"takes {sorted(methods)}")
        if call.after is not None and call.after >= index:
            raise ConfigError(f"calls[{index}]: after must be the index of an earlier call, "
                              f"got {call.after}")
        try:
            commands.append(prepared(call, limit))
        except (ConfigError, MetadataError) as exc:
            raise ConfigError(f"calls[{index}] ({call.method}): {exc}") from None
    return commands


def _message(text: str) -> str:
    if len(text) <= MAX_MESSAGE_CHARS:
        return text
    return text[:MAX_MESSAGE_CHARS] + f" ... ({len(text) - MAX_MESSAGE_CHARS} characters cut)"


async def outcomes(run: RunCalls, commands: list[Chained], path: str) -> AsyncIterator[bytes]:
    """Run `commands`; one `CallOutcome` line for each as it is known."""
    index = 0
    answers = run(commands)
    try:
        async for failure in answers:
            outcome = CallOutcome(status=200)
            if isinstance(failure, WTransferError):
                outcome = CallOutcome(status=status_of(failure), error=error_kind(failure),
                                      message=_message(str(failure)))
            elif failure is not None:  # as the app's handler answers one: a 500
                log.error("POST %s: %s failed", path, commands[index][0], exc_info=failure)
                outcome = CallOutcome(status=500, error="InternalError",
                                      message=f"{type(failure).__name__}: {failure}"[:500])
            index += 1
            yield (json.dumps(record_to_wire(outcome)) + "\n").encode()
    finally:  # (a client gone: the calls not yet run never run)
        await answers.aclose()


def add_weight_calls(app: FastAPI, path: str, run: RunCalls, body_of: BodyOf, *,
                     methods: Collection[str] = tuple(BATCHED_CALLS),
                     max_body_bytes: int) -> None:
    """Serve a batch of weight-sync calls at `path` on `app`, run by `run` (a development
    route, as each call's own; `methods`: the calls it takes)."""

    @app.post(path)
    async def weight_calls(request: Request) -> StreamingResponse:
        commands = parse_calls(field(await body_of(request, ("calls",)), "calls", list),
                               methods, max_body_bytes)
        return StreamingResponse(outcomes(run, commands, path),
                                 media_type="application/x-ndjson")
