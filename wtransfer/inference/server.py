"""The HTTP server: tokens-in/tokens-out generation, dev-mode RL endpoints, health, metrics.

Request bodies are JSON, or msgpack (``Content-Type: application/msgpack``) where they carry
bytes (IPC handles); both are decoded by validating code, never unpickled. Errors are JSON
``{"error": type, "message": ...}`` with a 4xx status that says what to fix: 400 bad input,
401 missing/wrong key, 404 unknown route (dev routes without --dev-mode), 409 lifecycle misuse,
413 body too large; 502/504 when the transfer's peer failed or timed out.
"""

from __future__ import annotations

import hmac
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from wtransfer import wire
from wtransfer.errors import (
    ConfigError,
    LifecycleError,
    MetadataError,
    PeerError,
    TransferTimeout,
    WTransferError,
)
from wtransfer.inference.async_engine import AsyncEngine
from wtransfer.inference.commands import check_pause_mode
from wtransfer.inference.params import SamplingParams

log = logging.getLogger("wtransfer.server")

MSGPACK = "application/msgpack"
class BadRequest(WTransferError):
    """A request body the server cannot use (answered with 400)."""


class BodyTooLarge(BadRequest):
    """A request body over the server's limit (answered with 413)."""


_STATUS: dict[type[WTransferError], int] = {
    BodyTooLarge: 413, BadRequest: 400, ConfigError: 400, MetadataError: 400,
    LifecycleError: 409, PeerError: 502, TransferTimeout: 504}
"""HTTP status of each error family, most specific first."""


def _error(status: int, exc: BaseException) -> JSONResponse:
    return JSONResponse({"error": type(exc).__name__, "message": str(exc)}, status_code=status)


async def _body(request: Request, limit: int) -> Any:
    chunks, size = [], 0
    async for chunk in request.stream():  # chunked bodies carry no Content-Length to check
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(f"body exceeds the {limit}-byte limit")
        chunks.append(chunk)
    raw = b"".join(chunks)
    if not raw:
        return {}
    if request.headers.get("content-type", "").startswith(MSGPACK):
        return wire.decode(raw, max_bytes=limit)
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"body is not valid JSON: {exc}") from None


def _field(body: Any, name: str, kind: type | tuple[type, ...], default: Any = ...) -> Any:
    if not isinstance(body, dict):
        raise BadRequest("body must be a JSON object")
    if name not in body or body[name] is None:
        if default is ...:
            raise BadRequest(f"missing field {name!r}")
        return default
    value = body[name]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise BadRequest(f"field {name!r} must be {getattr(kind, '__name__', kind)}")
    return value


def _sampling(data: Any) -> SamplingParams:
    if data is None:
        return SamplingParams()
    return wire.parse_record(SamplingParams, data, where="sampling_params")


def build_app(engine: AsyncEngine, *, dev_mode: bool = False, api_key: str | None = None,
              max_body_bytes: int = 64 << 20) -> FastAPI:
    """The FastAPI application serving `engine`."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if dev_mode:
            log.warning("development endpoints are ON (pause, weight updates): never expose "
                        "this server to untrusted clients")
        yield
        engine.shutdown()  # live requests end with finish_reason="abort", none dropped

    app = FastAPI(title="wtransfer", lifespan=lifespan)
    counters = {"requests": 0, "tokens": 0}

    @app.middleware("http")
    async def guard(request: Request,
                    call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        if api_key is not None:
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                return _error(401, BadRequest("missing or wrong 'Authorization: Bearer <key>'"))
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > max_body_bytes:
            return _error(413, BadRequest(f"body exceeds the {max_body_bytes}-byte limit"))
        return await call_next(request)

    @app.exception_handler(WTransferError)
    async def wtransfer_error(request: Request, exc: WTransferError) -> JSONResponse:
        status = next((code for kind, code in _STATUS.items() if isinstance(exc, kind)), 500)
        return _error(status, exc)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        s = await engine.stats()
        lines = [
            f"wtransfer_requests_total {counters['requests']}",
            f"wtransfer_generated_tokens_total {s['tokens_generated']}",
            f"wtransfer_running_requests {s['running']}",
            f"wtransfer_waiting_requests {s['waiting']}",
            f"wtransfer_paused {int(s['paused'])}",
            f'wtransfer_weight_version_info{{version="{s["weight_version"]}"}} 1',
            f"wtransfer_last_transfer_bytes {s['last_update_bytes']}",
            f"wtransfer_last_transfer_seconds {s['last_update_seconds']}",
            f"wtransfer_prefix_cache_hit_blocks_total {s['prefix_cache_hits']}",
            f"wtransfer_preemptions_total {s['preemptions']}",
        ]
        return PlainTextResponse("\n".join(lines) + "\n")

    @app.post("/inference/v1/generate")
    async def generate(request: Request) -> Response:
        body = await _body(request, max_body_bytes)
        token_ids = _field(body, "token_ids", list)
        if not token_ids or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                    for t in token_ids):
            raise BadRequest("token_ids must be a non-empty list of non-negative ints")
        params = _sampling(_field(body, "sampling_params", dict, None))
        rid = _field(body, "request_id", str, None)
        stream = _field(body, "stream", bool, False)
        counters["requests"] += 1
        outputs = engine.generate(token_ids, params, request_id=rid)
        first = await outputs.__anext__()  # surfaces validation errors before streaming
        if not stream:
            last = first
            async for output in outputs:
                last = output
                if await request.is_disconnected():
                    await outputs.aclose()  # aborts the request in the engine
                    return Response(status_code=499)
            return JSONResponse({"request_id": last.request_id,
                                 "choices": [c.to_wire() for c in last.outputs]})

        async def events() -> AsyncIterator[bytes]:
            try:
                async for chunk in _sse(first):
                    yield chunk
            finally:
                await outputs.aclose()  # a client that went away aborts its request

        async def _sse(first: Any) -> AsyncIterator[bytes]:
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

        return StreamingResponse(events(), media_type="text/event-stream")

    if dev_mode:
        _add_dev_routes(app, engine, max_body_bytes)
    return app


def _add_dev_routes(app: FastAPI, engine: AsyncEngine, limit: int) -> None:
    async def arg(request: Request, name: str, kind: type, default: Any = ...) -> Any:
        return _field(await _body(request, limit), name, kind, default)

    @app.post("/pause")
    async def pause(mode: str = "abort", clear_cache: str = "true") -> dict[str, Any]:
        if clear_cache.lower() not in ("true", "false", "1", "0"):
            raise BadRequest("clear_cache must be true or false")
        await engine.pause_generation(mode=check_pause_mode(mode),
                                      clear_cache=clear_cache.lower() in ("true", "1"))
        return {"status": "paused", "mode": mode}

    @app.post("/resume")
    async def resume() -> dict[str, str]:
        await engine.resume_generation()
        return {"status": "resumed"}

    @app.get("/is_paused")
    async def is_paused() -> dict[str, bool]:
        return {"is_paused": await engine.is_paused()}

    @app.post("/abort_requests")
    async def abort_requests(request: Request) -> dict[str, int]:
        ids = await arg(request, "request_ids", list, None)
        if ids is not None and not all(isinstance(i, str) for i in ids):
            raise BadRequest("request_ids must be a list of strings")
        return {"aborted": await engine.abort_requests(ids)}

    @app.post("/init_weight_transfer_engine")
    async def init(request: Request) -> dict[str, str]:
        await engine.init_weight_transfer_engine(await arg(request, "init_info", dict))
        return {"status": "ok"}

    @app.post("/start_weight_update")
    async def start() -> dict[str, str]:
        await engine.start_weight_update()
        return {"status": "ok"}

    @app.post("/update_weights")
    async def update(request: Request) -> dict[str, str]:
        await engine.update_weights(await arg(request, "update_info", dict))
        return {"status": "ok"}

    @app.post("/finish_weight_update")
    async def finish(request: Request) -> dict[str, str]:
        await engine.finish_weight_update(await arg(request, "weight_version", str, None))
        return {"status": "ok"}

    @app.post("/update_weight_version")
    async def update_version(request: Request) -> dict[str, str]:
        await engine.update_weight_version(await arg(request, "new_version", str))
        return {"status": "ok"}

    @app.get("/weight_info")
    async def weight_info() -> dict[str, Any]:
        return {"weight_version": await engine.get_weight_version(),
                "num_workers": engine.num_workers()}

    @app.get("/weight_fingerprint")
    async def weight_fingerprint() -> dict[str, Any]:
        return {"fingerprint": await engine.fingerprint()}
