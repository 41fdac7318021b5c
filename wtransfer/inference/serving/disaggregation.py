"""The HTTP side of prefill/decode disaggregation (`wtransfer serve --role prefill|decode`).

A **prefill** instance serves ``POST /prefill``: it computes a prompt's first token (its own
engine, the prompt's K/V kept at that token) and hands the K/V over to the decode instance
that asked (`handover.KVHandover`, to that instance's ``/kv`` routes, labelled with the weight
version it was computed under); it answers with the token and the version.

A **decode** instance (``--prefill-url URL``) serves generate as usual, but asks the prefill
instance first; the K/V lands in its `handover.KVTarget` through its ``/kv`` routes (a
receiver of its backend: the same routes as the weight-update ones, under ``/kv``, so its API
key guards them), and the engine decodes from it only under the same weight version
(`Replica.add_prefilled`). A prefill instance that fails, refuses or dies costs a local
prefill, not the request.
"""

from __future__ import annotations

import asyncio
import logging
import math
import uuid
from collections.abc import Awaitable, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any
from urllib.parse import urlparse

import httpx
from fastapi import FastAPI, Request

from wtransfer.errors import LifecycleError, PeerError, WTransferError
from wtransfer.inference.async_engine import AsyncEngine, Prefilled
from wtransfer.inference.commands import chained
from wtransfer.inference.params import SamplingParams
from wtransfer.inference.serving.handover import KVHandover, KVTarget, kv_shape
from wtransfer.inference.serving.http_body import field as body_field
from wtransfer.inference.serving.weight_calls import add_weight_calls
from wtransfer.receiver.engine import WeightTransferEngine
from wtransfer.registry import create_receiver
from wtransfer.wire import parse_record, record_to_wire

log = logging.getLogger("wtransfer.pd")
BodyOf = Callable[[Request, tuple[str, ...]], Awaitable[dict[str, Any]]]
PREFILL_FIELDS = ("token_ids", "sampling_params", "request_id", "kv_url", "kv_api_key",
                  "backend", "init_fields")


@dataclass
class Disaggregation:
    """This instance's part in P/D: its role, and for a decode instance, where its prefill
    instance and its own hand-over routes are."""

    role: str = "both"
    """"prefill", "decode", or "both" (no disaggregation)."""
    prefill_url: str | None = None
    prefill_api_key: str | None = None
    url: str | None = None
    """This instance's own URL (a decode instance's hand-over routes are under it)."""
    api_key: str | None = None
    """This instance's own API key (a prefill instance uses it on the hand-over routes)."""
    timeout_s: float = 60.0
    kv: KVTarget | None = None
    receiver: WeightTransferEngine[Any, Any] | None = None
    handover: KVHandover | None = None
    counts: dict[str, int] = field(default_factory=lambda: {"failed": 0})
    lane: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(
        1, thread_name_prefix="wtransfer-kv"))
    """Where this instance's blocking hand-over work runs (the receiver's calls, or the
    sends): never behind the event loop's other threads, which hundreds of requests waiting
    on their prefills could hold."""

    async def _on_lane(self, call: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.lane, call, *args)

    def setup(self, engine: AsyncEngine) -> None:
        """Build the hand-over ends this role needs (P/D runs on one worker per engine)."""
        config = engine.config
        if self.role == "both":
            return
        if config.tensor_parallel_size > 1 or config.data_parallel_size > 1:
            raise LifecycleError("--role prefill/decode run engines of one worker (no tensor "
                                 "or data parallelism) for now")
        if self.role == "prefill":
            self.handover = KVHandover(self.timeout_s)
            return
        runner = engine.core.replica.runner  # type: ignore[attr-defined]
        self.kv = KVTarget(kv_shape(runner, runner.model.config.max_position_embeddings))
        self.receiver = create_receiver(config.weight_transfer_backend, self.kv)

    async def prefilled(self, engine: AsyncEngine, token_ids: list[int],
                        params: SamplingParams, request_id: str) -> Prefilled | None:
        """A decode instance's remote prefill of one request: its first token and version,
        and its K/V when the hand-over landed; None when the prefill instance failed (the
        engine then prefills locally)."""
        assert self.prefill_url is not None and self.kv is not None and self.url is not None
        backend = engine.config.weight_transfer_backend
        init_fields: dict[str, Any] = {}
        if backend == "nccl":  # the prefill instance hosts the rendezvous
            init_fields["master_address"] = urlparse(self.prefill_url).hostname
        body = {"token_ids": token_ids, "sampling_params": record_to_wire(params),
                "request_id": request_id, "kv_url": self.url.rstrip("/") + "/kv",
                "kv_api_key": self.api_key, "backend": backend, "init_fields": init_fields}
        headers = ({"Authorization": f"Bearer {self.prefill_api_key}"}
                   if self.prefill_api_key else {})
        try:  # (an async request: no thread waits while the prefill instance works)
            async with httpx.AsyncClient(base_url=self.prefill_url, headers=headers,
                                         timeout=self.timeout_s) as http:
                response = await http.post("/prefill", json=body)
            if response.status_code != 200:
                raise PeerError(f"POST {self.prefill_url}/prefill -> {response.status_code}: "
                                f"{response.text[:300]}")
            reply = response.json()
        except (WTransferError, httpx.HTTPError, ValueError) as exc:
            self.counts["failed"] += 1
            log.warning("remote prefill of %s failed; prefilling here: %s", request_id, exc)
            self.kv.take(request_id)
            return None
        logprob = reply.get("logprob")
        return Prefilled(int(reply["token"]), math.nan if logprob is None else float(logprob),
                         str(reply["weight_version"]), self.kv.take(request_id))

    def add_routes(self, app: FastAPI, engine: AsyncEngine, body_of: BodyOf,
                   max_body_bytes: int) -> None:
        """The routes of this role: ``/prefill`` (prefill), ``/kv/...`` (decode)."""
        if self.role == "prefill":
            self._prefill_route(app, engine, body_of)
        elif self.role == "decode":
            self._kv_routes(app, body_of, max_body_bytes)

    def _prefill_route(self, app: FastAPI, engine: AsyncEngine, body_of: BodyOf) -> None:
        handover = self.handover
        assert handover is not None

        @app.post("/prefill")
        async def prefill(request: Request) -> dict[str, Any]:
            body = await body_of(request, PREFILL_FIELDS)
            token_ids = body_field(body, "token_ids", list)
            params = parse_record(SamplingParams, body_field(body, "sampling_params", dict, {}),
                                  where="sampling_params")
            rid = body_field(body, "request_id", str, None) or uuid.uuid4().hex
            async for _ in engine.generate(token_ids, replace(params, max_tokens=1),
                                           request_id=rid, capture_kv=True):
                pass
            captured = await engine.take_captured(rid)
            if captured is None:
                raise LifecycleError(f"request {rid!r} ended before its first token; no K/V "
                                     "to hand over")
            moved = await self._on_lane(
                handover.send, body_field(body, "kv_url", str),
                body_field(body, "kv_api_key", str, None), body_field(body, "backend", str),
                body_field(body, "init_fields", dict, {}), rid, captured["kv"],
                captured["version"])
            logprob = float(captured["logprob"])
            return {"token": captured["token"],
                    "logprob": logprob if math.isfinite(logprob) else None,
                    "weight_version": captured["version"], "kv_bytes": moved}

    def _kv_routes(self, app: FastAPI, body_of: BodyOf, max_body_bytes: int) -> None:
        receiver = self.receiver
        assert receiver is not None

        @app.get("/kv/weight_info")
        async def kv_info() -> dict[str, Any]:
            return {"num_workers": 1, "update_state": receiver.state.value}

        @app.post("/kv/init_weight_transfer_engine")
        async def kv_init(request: Request) -> dict[str, str]:
            info = body_field(await body_of(request, ("init_info",)), "init_info", dict)
            await self._on_lane(receiver.init_transfer_engine, info)
            return {"status": "ok"}

        @app.post("/kv/start_weight_update")
        async def kv_start(request: Request) -> dict[str, str]:
            await body_of(request, ())
            await self._on_lane(receiver.start_weight_update)
            return {"status": "ok"}

        @app.post("/kv/update_weights")
        async def kv_update(request: Request) -> dict[str, str]:
            info = body_field(await body_of(request, ("update_info",)), "update_info", dict)
            await self._on_lane(receiver.update_weights, info)
            return {"status": "ok"}

        @app.post("/kv/finish_weight_update")
        async def kv_finish(request: Request) -> dict[str, str]:
            version = body_field(await body_of(request, ("weight_version",)),
                                 "weight_version", str, None)
            await self._on_lane(receiver.finish_weight_update, version)
            return {"status": "ok"}

        def on_lane(command: str, *args: Any) -> Future[Any]:
            return self.lane.submit(getattr(receiver, command), *args)

        add_weight_calls(app, "/kv/weight_calls",
                         lambda commands: chained(on_lane, commands, self.timeout_s), body_of,
                         methods=("start_weight_update", "update_weights",
                                  "finish_weight_update"),
                         max_body_bytes=max_body_bytes)

    def metrics(self) -> dict[str, int]:
        """This role's counters for /metrics."""
        out: dict[str, int] = {}
        if self.kv is not None:
            out["kv_bytes_received_total"] = self.kv.bytes_received
            out["remote_prefill_failures_total"] = self.counts["failed"]
        if self.handover is not None:
            out["kv_bytes_sent_total"] = self.handover.bytes_sent
        return out

    def close(self) -> None:
        """Release the hand-over ends and the lane."""
        self.lane.shutdown(wait=False, cancel_futures=True)
        if self.handover is not None:
            self.handover.close()
        if self.receiver is not None:
            self.receiver.shutdown()
