"""``POST /weight_calls``: several weight-sync calls in one request.

A sender's update is a short sequence of calls (start, update calls, finish). Each alone
costs a request's round trip and its parsing; `wtransfer.protocol.CallQueue` sends the calls
that wait together as one batch instead (a lone sender's whole update, usually). The server
checks the whole batch before any call runs (a 400 names the bad one), runs the calls in
order between the same two steps (`AsyncEngine.run_calls`), each only if the earlier call it
names as `after` succeeded, and streams each call's
`CallOutcome` as one JSON line the moment it is known, so a sender reuses a bucket's slot as
soon as that bucket's call is answered.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from wtransfer.errors import ConfigError, WTransferError, error_kind
from wtransfer.inference.async_engine import AsyncEngine
from wtransfer.inference.commands import Chained
from wtransfer.inference.serving.http_body import field, status_of
from wtransfer.records import CallOutcome, WeightCall
from wtransfer.wire import parse_record, record_to_wire

log = logging.getLogger("wtransfer.server")

MAX_CALLS = 4096
"""Most calls one batch may carry."""

def prepared(call: WeightCall) -> Chained:
    """`call` as an engine command, its arguments checked (a `ConfigError` names the bad
    one)."""
    args = call.args
    if call.method == "update_weights":
        return call.method, (field(args, "update_info", dict),), call.after
    if call.method == "finish_weight_update":
        return call.method, (field(args, "weight_version", str, None),), call.after
    if call.method == "discard_weight_update":
        return call.method, (field(args, "reason", str),), call.after
    return call.method, (), call.after


def parse_calls(items: list[Any]) -> list[Chained]:
    """Every call of a batch, checked before any runs."""
    if not 0 < len(items) <= MAX_CALLS:
        raise ConfigError(f"calls must hold 1 to {MAX_CALLS} calls, got {len(items)}")
    commands = []
    for index, item in enumerate(items):
        call = parse_record(WeightCall, item, where=f"calls[{index}]")
        if call.after is not None and call.after >= index:
            raise ConfigError(f"calls[{index}]: after must be the index of an earlier call, "
                              f"got {call.after}")
        try:
            commands.append(prepared(call))
        except ConfigError as exc:
            raise ConfigError(f"calls[{index}] ({call.method}): {exc}") from None
    return commands


async def outcomes(engine: AsyncEngine, commands: list[Chained]) -> AsyncIterator[bytes]:
    """Run `commands` in order; one `CallOutcome` line for each as it is known."""
    index = 0
    async for failure in engine.run_calls(commands):
        outcome = CallOutcome(status=200)
        if isinstance(failure, WTransferError):
            outcome = CallOutcome(status=status_of(failure), error=error_kind(failure),
                                  message=str(failure))
        elif failure is not None:  # as the app's handler answers one: a 500
            log.error("POST /weight_calls: %s failed", commands[index][0], exc_info=failure)
            outcome = CallOutcome(status=500, error="InternalError",
                                  message=f"{type(failure).__name__}: {failure}"[:500])
        index += 1
        yield (json.dumps(record_to_wire(outcome)) + "\n").encode()


def add_weight_calls(app: FastAPI, engine: AsyncEngine,
                     body_of: Callable[[Request, tuple[str, ...]],
                                       Awaitable[dict[str, Any]]]) -> None:
    """Serve ``POST /weight_calls`` on `app` (a development route, as each call's own)."""

    @app.post("/weight_calls")
    async def weight_calls(request: Request) -> StreamingResponse:
        commands = parse_calls(field(await body_of(request, ("calls",)), "calls", list))
        return StreamingResponse(outcomes(engine, commands), media_type="application/x-ndjson")
