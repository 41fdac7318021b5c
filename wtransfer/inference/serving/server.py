"""The HTTP server: tokens-in/tokens-out generation, dev-mode RL endpoints, health, metrics.

Request bodies are JSON, or msgpack (``Content-Type: application/msgpack``) where they carry
bytes (IPC handles); both are decoded by validating code, never unpickled (`http_body`). Every
error is JSON ``{"error": type, "message": ...}``: 400 bad input (unknown fields included), 401
missing/wrong key, 404 unknown route (dev routes without --dev-mode), 405 wrong method, 409
lifecycle misuse, 413 body too large, 422 bytes refused (a checksum mismatch, an incomplete
update, NaN or infinite values); 502/504 when the transfer's peer failed or timed out;
503 when the engine cannot serve (`/health` says why).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from wtransfer.errors import (
    ConfigError,
    TransferTimeout,
    WTransferError,
    error_kind,
)
from wtransfer.inference.async_engine import AsyncEngine
from wtransfer.inference.params import SamplingParams
from wtransfer.inference.serving.disaggregation import Disaggregation
from wtransfer.inference.serving.http_body import (
    check_fields,
    field,
    read_body,
    status_of,
)
from wtransfer.inference.serving.weight_calls import add_weight_calls
from wtransfer.records import check_pause_mode
from wtransfer.wire import parse_record

log = logging.getLogger("wtransfer.server")

_HTTP_NAMES = {401: "Unauthorized", 404: "NotFound", 405: "MethodNotAllowed"}
HEALTH_TIMEOUT_S = 2.0
"""How long /health waits for the engine thread before answering from what it knows."""
_GENERATE_FIELDS = ("token_ids", "sampling_params", "request_id", "stream", "lora")
DEV_ROUTES = ("/pause", "/resume", "/is_paused", "/abort_requests",
              "/init_weight_transfer_engine", "/start_weight_update", "/update_weights",
              "/stage_weight_update", "/discard_weight_update", "/push_weights",
              "/finish_weight_update", "/weight_calls", "/rollback_weights",
              "/update_weight_version",
              "/weight_info",
              "/weight_fingerprint")
"""The routes `--dev-mode` adds (pause/resume and the weight-sync calls)."""


METRICS_HELP = {
    "requests_total": "generate requests received",
    "generated_tokens_total": "output tokens generated",
    "running_requests": "requests being computed",
    "waiting_requests": "requests queued",
    "paused": "1 while a pause is in effect",
    "weights_torn": "1 while a failed update left some weights new and some old",
    "last_transfer_bytes": "bytes the engine's receiver took in during its last update: the "
                           "packed buckets, alignment padding included (a sender's "
                           "TransferStats.bytes counts the tensors' own bytes)",
    "last_transfer_seconds": "the last update's time from start to finish at the engine",
    "last_update_stall_ms": "the longest time the last update kept the engine from computing, "
                            "between two steps (its pause, or a staged update's commit); NaN "
                            "until the first step after it",
    "prefix_cache_hit_blocks_total": "KV blocks reused from the prefix cache",
    "preemptions_total": "sequences preempted for lack of KV blocks",
    "prefilled_remote_total": "requests decoded from a prefill instance's K/V (same version)",
    "prefilled_local_total": "requests prefilled here",
    "kv_bytes_received_total": "K/V bytes handed over to this decode instance",
    "remote_prefill_failures_total": "remote prefills that failed (prefilled here instead)",
    "kv_bytes_sent_total": "K/V bytes this prefill instance handed over",
}
"""What each /metrics line counts (its HELP line)."""


def _no_route(method: str, path: str, dev_mode: bool) -> str:
    """What a 404 says: the route, and how to reach what was probably meant."""
    message = f"no route {method} {path}"
    if path.rstrip("/") != path and path.rstrip("/"):
        message += f" (did you mean {path.rstrip('/')}?)"
    elif path in DEV_ROUTES and not dev_mode:
        message += ": it is a development route; start the server with --dev-mode to enable it"
    return message


def _error(status: int, kind: str, message: str) -> JSONResponse:
    return JSONResponse({"error": kind, "message": message}, status_code=status)


def _label(value: str) -> str:
    """A Prometheus label value: backslash, double quote and newline escaped."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class Guard:
    """ASGI middleware: the API key on every route, and the body limit from Content-Length.

    A plain ASGI wrapper (not Starlette's BaseHTTPMiddleware, which hides a client's
    disconnect from the route until the response starts)."""

    def __init__(self, app: ASGIApp, *, api_key: str | None, max_body_bytes: int) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key is not None else None
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Refuse with 401 or 413 before the app runs, else pass the request on."""
        if scope["type"] == "http":
            headers = dict(scope["headers"])
            refusal = None
            if self.expected is not None and not hmac.compare_digest(
                    headers.get(b"authorization", b""), self.expected):
                refusal = _error(401, "Unauthorized",
                                 "missing or wrong 'Authorization: Bearer <key>'")
            length = headers.get(b"content-length", b"")
            if refusal is None and length.isdigit() and int(length) > self.max_body_bytes:
                refusal = _error(413, "BodyTooLarge",
                                 f"body exceeds the {self.max_body_bytes}-byte limit")
            if refusal is not None:
                await refusal(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def _until_disconnected(request: Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(0.1)


def build_app(engine: AsyncEngine, *, dev_mode: bool = False, api_key: str | None = None,
              max_body_bytes: int = 64 << 20, pd: Disaggregation | None = None) -> FastAPI:
    """The FastAPI application serving `engine` (with `pd`, its part in prefill/decode
    disaggregation: `wtransfer.inference.serving.disaggregation`)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if dev_mode:
            log.warning("development endpoints are ON (pause, weight updates): never expose "
                        "this server to untrusted clients")
        yield
        engine.shutdown()  # live requests end with finish_reason="abort", none dropped
        if pd is not None:
            pd.close()

    app = FastAPI(title="wtransfer", lifespan=lifespan, redirect_slashes=False)
    counters = {"requests": 0}

    async def body_of(request: Request, allowed: tuple[str, ...]) -> dict[str, Any]:
        raw = await read_body(request.stream(), request.headers.get("content-type", ""),
                              max_body_bytes)
        return check_fields(raw, allowed)

    app.add_middleware(Guard, api_key=api_key, max_body_bytes=max_body_bytes)

    @app.exception_handler(WTransferError)
    async def wtransfer_error(request: Request, exc: WTransferError) -> JSONResponse:
        return _error(status_of(exc), error_kind(exc), str(exc))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        kind = _HTTP_NAMES.get(exc.status_code, "HTTPError")
        message = (_no_route(request.method, request.url.path, dev_mode)
                   if exc.status_code == 404
                   else f"{request.method} is not allowed on {request.url.path}"
                   if exc.status_code == 405 else str(exc.detail))
        return _error(exc.status_code, kind, message)

    @app.exception_handler(Exception)
    async def unexpected_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("%s %s failed", request.method, request.url.path)
        return _error(500, "InternalError", f"{type(exc).__name__}: {exc}"[:500])

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        where = "; ".join(f"{'.'.join(map(str, e.get('loc', ())))}: {e.get('msg')}"
                          for e in exc.errors()[:5])
        return _error(400, "ConfigError", where)

    @app.get("/health")
    async def health() -> JSONResponse:
        failure = engine.failure()
        if failure is not None:
            return JSONResponse({"status": "dead", "reason": failure}, status_code=503)
        try:
            info = await engine.weight_info(timeout=HEALTH_TIMEOUT_S)
        except TransferTimeout:  # a long transfer holds the engine thread: it is alive
            return JSONResponse({"status": "ok", "busy": True})
        if info["torn"]:
            return JSONResponse({"status": "torn", "reason": info["failure"]}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        s = await engine.stats()
        values = {
            "requests_total": counters["requests"],
            "generated_tokens_total": s["tokens_generated"],
            "running_requests": s["running"], "waiting_requests": s["waiting"],
            "paused": int(s["paused"]), "weights_torn": int(s["torn"]),
            "last_transfer_bytes": s["last_update_bytes"],
            "last_transfer_seconds": s["last_update_seconds"],
            "last_update_stall_ms": ("NaN" if s["update_stall_ms"] is None
                                     else s["update_stall_ms"]),
            "prefix_cache_hit_blocks_total": s["prefix_cache_hits"],
            "preemptions_total": s["preemptions"],
            "prefilled_remote_total": s.get("prefilled_remote", 0),
            "prefilled_local_total": s.get("prefilled_local", 0),
            **(pd.metrics() if pd is not None else {}),
        }
        lines = []
        for name, value in values.items():
            lines += [f"# HELP wtransfer_{name} {METRICS_HELP[name]}",
                      f"wtransfer_{name} {value}"]
        lines += ["# HELP wtransfer_weight_version_info the weight version served now",
                  f'wtransfer_weight_version_info{{version="{_label(s["weight_version"])}"}} 1']
        return PlainTextResponse("\n".join(lines) + "\n")

    @app.post("/inference/v1/generate")
    async def generate(request: Request) -> Response:
        body = await body_of(request, _GENERATE_FIELDS)
        token_ids = field(body, "token_ids", list)
        if not token_ids or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                    for t in token_ids):
            raise ConfigError("token_ids must be a non-empty list of non-negative ints")
        params = parse_record(SamplingParams, field(body, "sampling_params", dict, {}),
                              where="sampling_params")
        lora = field(body, "lora", str, None)
        if lora is not None:
            if params.lora not in (None, lora):
                raise ConfigError(f"lora {lora!r} and sampling_params.lora {params.lora!r} "
                                  "differ; give one")
            params = replace(params, lora=lora)
        rid = field(body, "request_id", str, None)
        stream = field(body, "stream", bool, False)
        counters["requests"] += 1
        prefilled = None
        if pd is not None and pd.role == "decode":
            rid = rid or uuid.uuid4().hex
            prefilled = await pd.prefilled(engine, token_ids, params, rid)
        outputs = engine.generate(token_ids, params, request_id=rid, prefilled=prefilled)
        first = await outputs.__anext__()  # surfaces validation errors before streaming
        if stream:
            return StreamingResponse(_events(first, outputs), media_type="text/event-stream")

        async def finish() -> Any:
            last = first
            async for output in outputs:
                last = output
            return last

        finishing = asyncio.ensure_future(finish())
        watching = asyncio.ensure_future(_until_disconnected(request))
        await asyncio.wait({finishing, watching}, return_when=asyncio.FIRST_COMPLETED)
        watching.cancel()
        if not finishing.done():  # the client went away: abort its request in the engine
            finishing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await finishing
            await outputs.aclose()
            return Response(status_code=499)
        last = finishing.result()
        return JSONResponse({"request_id": last.request_id,
                             "choices": [c.to_wire() for c in last.outputs]})

    if dev_mode:
        _add_dev_routes(app, engine, body_of, max_body_bytes)
    if pd is not None:
        pd.add_routes(app, engine, body_of, max_body_bytes)
    return app


async def _events(first: Any, outputs: Any) -> AsyncIterator[bytes]:
    """Server-sent events: new tokens as they come, then the final body and ``[DONE]``; a
    client that goes away (the response is cancelled) aborts its request."""
    try:
        sent, out = 0, first
        while True:
            tokens = out.outputs[0].token_ids
            if len(tokens) > sent:
                yield f"data: {json.dumps({'token_ids': tokens[sent:]})}\n\n".encode()
                sent = len(tokens)
            if out.finished:
                final = {"request_id": out.request_id,
                         "choices": [c.to_wire() for c in out.outputs]}
                yield f"data: {json.dumps(final)}\n\ndata: [DONE]\n\n".encode()
                return
            out = await outputs.__anext__()
    finally:
        await outputs.aclose()


BodyOf = Callable[[Request, tuple[str, ...]], Awaitable[dict[str, Any]]]


def _flag(name: str, value: bool | str | None) -> bool | None:
    """A true/false parameter given as a JSON bool or as text ("true", "false", "1", "0")."""
    if value is None or isinstance(value, bool):
        return value
    if value.lower() not in ("true", "false", "1", "0"):
        raise ConfigError(f"{name} must be true or false, got {value!r:.40}")
    return value.lower() in ("true", "1")


def _query_or_body(name: str, query: Any, body: Any, default: Any) -> Any:
    """A parameter a route takes from its query or its JSON body (the same name in both);
    given in both with different values, a `ConfigError` naming it."""
    if query is not None and body is not None and query != body:
        raise ConfigError(f"{name} is {query!r} in the query and {body!r} in the body; "
                          "give it once")
    return query if query is not None else body if body is not None else default


def _add_dev_routes(app: FastAPI, engine: AsyncEngine, body_of: BodyOf,
                    max_body_bytes: int) -> None:
    async def arg(request: Request, name: str, kind: type, default: Any = ...) -> Any:
        return field(await body_of(request, (name,)), name, kind, default)

    @app.post("/pause")
    async def pause(request: Request, mode: str | None = None,
                    clear_cache: str | None = None) -> dict[str, Any]:
        body = await body_of(request, ("mode", "clear_cache"))
        chosen = check_pause_mode(_query_or_body("mode", mode, field(body, "mode", str, None),
                                                 "abort"))
        clear = _query_or_body("clear_cache", _flag("clear_cache", clear_cache),
                               _flag("clear_cache", field(body, "clear_cache", (bool, str),
                                                          None)), True)
        await engine.pause_generation(mode=chosen, clear_cache=clear)
        return {"status": "paused", "mode": chosen, "clear_cache": clear}

    @app.post("/resume")
    async def resume(request: Request) -> dict[str, str]:
        await body_of(request, ())
        await engine.resume_generation()
        return {"status": "resumed"}

    @app.get("/is_paused")
    async def is_paused() -> dict[str, bool]:
        return {"is_paused": await engine.is_paused()}

    @app.post("/abort_requests")
    async def abort_requests(request: Request) -> dict[str, int]:
        ids = await arg(request, "request_ids", list, None)
        if ids is not None and not all(isinstance(i, str) for i in ids):
            raise ConfigError("request_ids must be a list of strings")
        return {"aborted": await engine.abort_requests(ids)}

    @app.post("/init_weight_transfer_engine")
    async def init(request: Request) -> dict[str, str]:
        await engine.init_weight_transfer_engine(await arg(request, "init_info", dict))
        return {"status": "ok"}

    @app.post("/start_weight_update")
    async def start(request: Request) -> dict[str, str]:
        await body_of(request, ())
        await engine.start_weight_update()
        return {"status": "ok"}

    @app.post("/update_weights")
    async def update(request: Request) -> dict[str, str]:
        await engine.update_weights(await arg(request, "update_info", dict))
        return {"status": "ok"}

    @app.post("/push_weights")
    async def push(request: Request) -> dict[str, Any]:
        body = await body_of(request, ("address", "backend", "init_fields"))
        return await engine.push_weights(field(body, "address", str),
                                         field(body, "backend", str),
                                         field(body, "init_fields", dict, {}))

    @app.post("/stage_weight_update")
    async def stage(request: Request) -> dict[str, str]:
        await body_of(request, ())
        await engine.stage_weight_update()
        return {"status": "ok"}

    @app.post("/discard_weight_update")
    async def discard(request: Request) -> dict[str, str]:
        await engine.discard_weight_update(await arg(request, "reason", str, "discarded"))
        return {"status": "ok"}

    @app.post("/finish_weight_update")
    async def finish(request: Request) -> dict[str, str]:
        await engine.finish_weight_update(await arg(request, "weight_version", str, None))
        return {"status": "ok"}

    add_weight_calls(app, "/weight_calls", engine.run_calls, body_of,
                     max_body_bytes=max_body_bytes)

    @app.post("/rollback_weights")
    async def rollback(request: Request) -> dict[str, str]:
        await body_of(request, ())
        await engine.rollback_weights()
        return {"status": "ok", "weight_version": await engine.get_weight_version()}

    @app.post("/update_weight_version")
    async def update_version(request: Request) -> dict[str, str]:
        await engine.update_weight_version(await arg(request, "new_version", str))
        return {"status": "ok"}

    @app.get("/weight_info")
    async def weight_info() -> dict[str, Any]:
        info = await engine.weight_info()
        return {"weight_version": info["weight_version"], "num_workers": engine.num_workers(),
                "update_state": info["update_state"], "torn": info["torn"],
                "failure": info["failure"], "rollback": info["rollback"],
                "update_staging": info["update_staging"],
                "update_stall_ms": info["update_stall_ms"],
                "update_commit_ms": info["update_commit_ms"],
                "previous_version": info["previous_version"],
                "adapters": info["adapters"],
                "workers": info["workers"]}

    @app.get("/weight_fingerprint")
    async def weight_fingerprint() -> dict[str, Any]:
        return {"fingerprint": await engine.fingerprint()}
