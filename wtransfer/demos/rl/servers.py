"""The demo's two ways to reach an engine: `wtransfer serve` over HTTP, or in process.

Both expose the same small surface: `client` (a WeightSyncClient for the sender), `generate`
(futures of completed choices), `stream` (a request whose progress can be watched), `pause`,
`resume`, `inflight` and `close`. A choice is the HTTP API's dict: token_ids, logprobs,
finish_reason, weight_versions.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import torch

from wtransfer.control.clients import HTTPClient, http_session
from wtransfer.errors import TransferTimeout
from wtransfer.inference import (
    AsyncEngine,
    EngineConfig,
    LocalEngineClient,
    PauseMode,
    SamplingParams,
)
from wtransfer.inference.engine_core import EngineCore
from wtransfer.launch.processes import free_port
from wtransfer.protocol import WeightSyncClient

CALL_TIMEOUT_S = 600.0
"""Deadline of pause, resume and status calls into the in-process engine."""


class FreshEngineReference:
    """Greedy continuations from a fresh engine holding a trainer's weights (what the demo
    checks mid-flight requests against)."""

    def __init__(self, model: str, state: dict[str, torch.Tensor]) -> None:
        self.engine = AsyncEngine(EngineConfig(model=model, batch_invariant=True))
        core = self.engine.core
        assert isinstance(core, EngineCore)  # data_parallel_size is 1
        core.call(core.replica.model.load_state_dict, state).result(timeout=60)
        self.params: dict[str, Any] = {}
        """Sampling parameters every continuation adds (e.g. the adapter to use)."""

    async def _generate(self, prompt: list[int], max_tokens: int) -> list[int]:
        last = None
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, **self.params)
        async for out in self.engine.generate(prompt, params):
            last = out
        assert last is not None
        return last.outputs[0].token_ids

    def __call__(self, prompt: list[int], max_tokens: int) -> list[int]:
        """Greedy tokens continuing `prompt`."""
        return asyncio.run(self._generate(prompt, max_tokens))

    def close(self) -> None:
        """Stop the engine."""
        self.engine.shutdown()


class Stream:
    """A request in flight: `tokens` grows as it streams; `result` is the final choice."""

    def __init__(self) -> None:
        self.tokens = 0
        self.result: Future[dict[str, Any]] = Future()

    def follow(self, future: Future[dict[str, Any]]) -> Stream:
        """Complete `result` with `future`'s outcome when it is done."""
        future.add_done_callback(lambda f: self.result.set_result(f.result())
                                 if f.exception() is None
                                 else self.result.set_exception(f.exception()))
        return self


def last_stall(weight_info: Any, within_s: float = 2.0) -> float | None:
    """`update_stall_ms` of the last update, waiting (up to `within_s`) for the engine's first
    step after it, which closes its window; None when no step came (an idle engine)."""
    deadline = time.monotonic() + within_s
    while (stall := weight_info()["update_stall_ms"]) is None and time.monotonic() < deadline:
        time.sleep(0.005)
    return None if stall is None else float(stall)


class HTTPPolicyServer:
    """`wtransfer serve --dev-mode --batch-invariant` in a child process."""

    def __init__(self, *, model: str, seed: int, backend: str, data_parallel_size: int = 1,
                 update_staging: str = "auto", tensor_parallel_size: int = 1,
                 start_timeout_s: float = 120, update_rollback: str = "auto",
                 max_loras: int = 0, max_lora_rank: int = 16, device: str = "cpu",
                 log_path: Path | None = None, weights_from: str | None = None,
                 extra_args: tuple[str, ...] = ()):
        self.model = model
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        """Where the server's output goes (None: a temporary file, gone at `close`)."""
        # closed in close(); a file, as a pipe nobody reads could fill
        self._log = (open(log_path, "wb") if log_path is not None  # noqa: SIM115
                     else tempfile.TemporaryFile())  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "wtransfer", "serve", "--model", model, "--seed", str(seed),
             "--port", str(port), "--dev-mode", "--batch-invariant", "--device", device,
             "--weight-transfer-backend", backend, "--update-staging", update_staging,
             "--update-rollback", update_rollback,
             "--data-parallel-size", str(data_parallel_size),
             "--tensor-parallel-size", str(tensor_parallel_size),
             "--max-loras", str(max_loras), "--max-lora-rank", str(max_lora_rank),
             *(["--weights-from", weights_from] if weights_from else []), *extra_args],
            stdout=subprocess.DEVNULL, stderr=self._log)
        self.http = http_session(self.url, timeout=300, max_connections=256)
        deadline = time.monotonic() + start_timeout_s
        while not self._healthy():
            if self.proc.poll() is not None:
                self._log.seek(0)
                err = self._log.read().decode(errors="replace")
                raise RuntimeError(f"wtransfer serve exited: {err[-2000:]}")
            if time.monotonic() > deadline:
                raise TransferTimeout(f"server not healthy within {start_timeout_s}s")
            time.sleep(0.1)
        self.client: WeightSyncClient = HTTPClient(self.url)
        self._pool = ThreadPoolExecutor(max_workers=128, thread_name_prefix="rollout")
        self.staging = str(self.weight_info()["update_staging"])
        """How the server lands updates ("off": in place, so the demo pauses around them)."""

    def _healthy(self) -> bool:
        try:
            return self.http.get("/health", timeout=1).status_code == 200
        except httpx.TransportError:
            return False

    def _post(self, prompt: list[int], params: dict[str, Any]) -> dict[str, Any]:
        body = self.http.post("/inference/v1/generate",
                              json={"token_ids": prompt, "sampling_params": params})
        body.raise_for_status()
        return dict(body.json()["choices"][0])

    def generate(self, prompts: list[list[int]], params: dict[str, Any]
                 ) -> list[Future[dict[str, Any]]]:
        """Submit every prompt at once."""
        return [self._pool.submit(self._post, p, params) for p in prompts]

    def stream(self, prompt: list[int], params: dict[str, Any]) -> Stream:
        """Submit one streamed request."""
        handle = Stream()

        def run() -> None:
            try:
                with self.http.stream("POST", "/inference/v1/generate", json={
                        "token_ids": prompt, "sampling_params": params, "stream": True}) as r:
                    for line in r.iter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        event = json.loads(line[6:])
                        if "choices" in event:
                            handle.result.set_result(event["choices"][0])
                        else:
                            handle.tokens += len(event["token_ids"])
            except BaseException as exc:
                if not handle.result.done():
                    handle.result.set_exception(exc)

        self._pool.submit(run)
        return handle

    def pause(self, mode: str, clear_cache: bool) -> None:
        """POST /pause."""
        self.http.post("/pause", params={"mode": mode, "clear_cache": str(clear_cache).lower()}
                       ).raise_for_status()

    def resume(self) -> None:
        """POST /resume."""
        self.http.post("/resume").raise_for_status()

    def weight_version(self) -> str:
        """GET /weight_info."""
        return str(self.weight_info()["weight_version"])

    def weight_info(self) -> dict[str, Any]:
        """GET /weight_info."""
        return dict(self.http.get("/weight_info").json())

    def stall_ms(self) -> float | None:
        """The last update's stall (`update_stall_ms`), once the engine stepped after it."""
        return last_stall(self.weight_info)

    def reference(self, state: dict[str, torch.Tensor]) -> FreshEngineReference:
        """Greedy continuations from a fresh engine holding the weights `state`."""
        return FreshEngineReference(self.model, state)

    def inflight(self) -> int:
        """Requests running or waiting in the engine."""
        count = 0
        for line in self.http.get("/metrics").text.splitlines():
            if line.startswith(("wtransfer_running_requests ", "wtransfer_waiting_requests ")):
                count += int(line.split()[1])
        return count

    def close(self) -> None:
        """SIGTERM the server and wait for it."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.http.close()
        self._log.close()


class LocalPolicyServer:
    """An `AsyncEngine` in this process, on its own event-loop thread."""

    def __init__(self, *, model: str, seed: int, backend: str,
                 data_parallel_size: int = 1, update_staging: str = "auto",
                 tensor_parallel_size: int = 1, max_loras: int = 0,
                 max_lora_rank: int = 16) -> None:
        self.model = model
        self.engine = AsyncEngine(EngineConfig(
            model=model, seed=seed, batch_invariant=True, weight_transfer_backend=backend,
            max_num_seqs=256, data_parallel_size=data_parallel_size,
            tensor_parallel_size=tensor_parallel_size, max_loras=max_loras,
            max_lora_rank=max_lora_rank,
            update_staging=None if update_staging == "auto" else update_staging))
        self.client: WeightSyncClient = LocalEngineClient(self.engine)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self.staging = str(self.weight_info()["update_staging"])
        """How the engine lands updates ("off": in place, so the demo pauses around them)."""

    def weight_info(self) -> dict[str, Any]:
        """The engine's weight info."""
        return dict(self._submit(self.engine.weight_info()).result(timeout=CALL_TIMEOUT_S))

    def stall_ms(self) -> float | None:
        """The last update's stall (`update_stall_ms`), once the engine stepped after it."""
        return last_stall(self.weight_info)

    def _submit(self, coro: Any) -> Future[Any]:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    async def _collect(self, prompt: list[int], params: dict[str, Any],
                       handle: Stream | None = None) -> dict[str, Any]:
        last = None
        async for out in self.engine.generate(prompt, SamplingParams(**params)):
            last = out
            if handle is not None:
                handle.tokens = len(out.outputs[0].token_ids)
        assert last is not None
        return last.outputs[0].to_wire()

    def generate(self, prompts: list[list[int]], params: dict[str, Any]
                 ) -> list[Future[dict[str, Any]]]:
        """Submit every prompt at once."""
        return [self._submit(self._collect(p, params)) for p in prompts]

    def stream(self, prompt: list[int], params: dict[str, Any]) -> Stream:
        """Submit one request whose progress is visible."""
        handle = Stream()
        return handle.follow(self._submit(self._collect(prompt, params, handle)))

    def pause(self, mode: PauseMode, clear_cache: bool) -> None:
        """Pause the engine."""
        paused = self._submit(self.engine.pause_generation(mode=mode, clear_cache=clear_cache))
        paused.result(timeout=CALL_TIMEOUT_S)

    def resume(self) -> None:
        """Resume the engine."""
        self._submit(self.engine.resume_generation()).result(timeout=CALL_TIMEOUT_S)

    def weight_version(self) -> str:
        """The engine's weight label."""
        return str(self._submit(self.engine.get_weight_version()).result(timeout=CALL_TIMEOUT_S))

    def reference(self, state: dict[str, torch.Tensor]) -> FreshEngineReference:
        """Greedy continuations from a fresh engine holding the weights `state`."""
        return FreshEngineReference(self.model, state)

    def inflight(self) -> int:
        """Requests running or waiting in the engine."""
        stats = self._submit(self.engine.stats()).result(timeout=CALL_TIMEOUT_S)
        return int(stats["running"] + stats["waiting"])

    def close(self) -> None:
        """Shut the engine and its loop down."""
        self.engine.shutdown()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
