"""The demo's policy server on vLLM: an in-process `AsyncLLM` serving the trainer's initial
policy (saved as a Hugging Face checkpoint), fed by a wtransfer backend inside vLLM
(`wtransfer_vllm`). Same surface as the servers in `servers.py`."""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import threading
from collections.abc import Coroutine
from concurrent.futures import Future
from typing import Any, TypeVar

import torch

from wtransfer.demos.rl.servers import CALL_TIMEOUT_S, Stream
from wtransfer.errors import ConfigError
from wtransfer.inference import PauseMode, load_model, save_pretrained

T = TypeVar("T")


def _choice(completion: Any) -> dict[str, Any]:
    """vLLM's completion as the HTTP API's choice dict."""
    logprobs = [next(iter(step.values())).logprob if step else float("nan")
                for step in (completion.logprobs or [])]
    return {"token_ids": list(completion.token_ids), "logprobs": logprobs,
            "finish_reason": completion.finish_reason,
            "weight_versions": [{"version": s.version, "start": s.start, "end": s.end}
                                for s in (completion.weight_versions or [])]}


class VLLMPolicyServer:
    """vLLM's `AsyncLLM` on its own event-loop thread, with a `wtransfer-<backend>` engine."""

    def __init__(self, *, model: str, seed: int, backend: str,
                 data_parallel_size: int = 1) -> None:
        if data_parallel_size != 1:
            raise ConfigError("--data-parallel-size is not wired for --engine vllm in this demo")
        try:
            import wtransfer_vllm
            from vllm import AsyncEngineArgs
            from vllm.v1.engine.async_llm import AsyncLLM
        except ImportError as exc:
            raise ConfigError(f"--engine vllm needs vLLM and wtransfer-vllm ({exc}); "
                              "`make test-vllm` builds .venv-vllm with both: run "
                              ".venv-vllm/bin/python -m wtransfer demo --engine vllm") from None
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        self.model = model
        self._dir = tempfile.mkdtemp(prefix="wtransfer-vllm-demo-")
        save_pretrained(load_model(model, seed=seed), self._dir)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._inflight = 0
        self._lock = threading.Lock()
        args = AsyncEngineArgs(model=self._dir, skip_tokenizer_init=True, enforce_eager=True,
                               dtype="float32", max_model_len=2048,
                               **wtransfer_vllm.engine_kwargs(backend))

        async def start() -> Any:
            return AsyncLLM.from_engine_args(args)

        self.llm = self._wait(start())
        self.client = wtransfer_vllm.AsyncLLMClient(self.llm, loop=self._loop)

    def _wait(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(CALL_TIMEOUT_S)

    async def _run(self, prompt: list[int], params: dict[str, Any],
                   handle: Stream | None = None) -> dict[str, Any]:
        from vllm import SamplingParams

        with self._lock:
            self._inflight += 1
        try:
            last = None
            async for out in self.llm.generate({"prompt_token_ids": prompt},
                                               SamplingParams(logprobs=0, **params),
                                               request_id=os.urandom(8).hex()):
                last = out
                if handle is not None:
                    handle.tokens = len(out.outputs[0].token_ids)
            assert last is not None
            return _choice(last.outputs[0])
        finally:
            with self._lock:
                self._inflight -= 1

    def generate(self, prompts: list[list[int]], params: dict[str, Any]
                 ) -> list[Future[dict[str, Any]]]:
        """Submit every prompt at once."""
        return [asyncio.run_coroutine_threadsafe(self._run(p, params), self._loop)
                for p in prompts]

    def stream(self, prompt: list[int], params: dict[str, Any]) -> Stream:
        """Submit one request whose progress is visible."""
        handle = Stream()
        return handle.follow(asyncio.run_coroutine_threadsafe(self._run(prompt, params, handle),
                                                              self._loop))

    staging = "off"
    """These engines land updates in place: the demo pauses around them."""

    def stall_ms(self) -> float | None:
        """Not measured for this engine."""
        return None

    def pause(self, mode: PauseMode, clear_cache: bool) -> None:
        """Pause vLLM (keep + clear_cache: kept requests re-prefill with the new weights)."""
        self._wait(self.llm.pause_generation(mode=mode, clear_cache=clear_cache))

    def resume(self) -> None:
        """Resume vLLM."""
        self._wait(self.llm.resume_generation())

    def weight_version(self) -> str:
        """vLLM's weight label."""
        return str(self._wait(self.llm.get_weight_version()))

    def inflight(self) -> int:
        """Requests submitted and not finished."""
        with self._lock:
            return self._inflight

    def reference(self, state: dict[str, torch.Tensor]) -> VLLMReference:
        """Greedy continuations from this engine, which holds the final weights now."""
        return VLLMReference(self)

    def close(self) -> None:
        """Shut vLLM and its loop down; remove the checkpoint."""
        self.llm.shutdown()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        shutil.rmtree(self._dir, ignore_errors=True)


class VLLMReference:
    """Greedy tokens from the demo's own vLLM engine once training ended (its caches were
    cleared at every pause, so nothing computed with older weights is reused)."""

    def __init__(self, server: VLLMPolicyServer) -> None:
        self.server = server

    def __call__(self, prompt: list[int], max_tokens: int) -> list[int]:
        """Greedy tokens continuing `prompt`."""
        choice = self.server._wait(self.server._run(prompt, {"max_tokens": max_tokens,
                                                             "temperature": 0.0}))
        return list(choice["token_ids"])

    def close(self) -> None:
        """Nothing to release: the server closes with the demo."""
