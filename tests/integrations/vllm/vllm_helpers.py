"""Shared pieces of the vLLM tests: tiny random Qwen3 checkpoints, an AsyncLLM on its own
event-loop thread, `vllm serve` in a child process, and trainer init infos."""

import asyncio
import json
import os
import subprocess
import sys
import threading
import time

import httpx
import torch
import wtransfer_vllm

import wtransfer
from wtransfer.launch.processes import free_port
from wtransfer.testing.conformance import wait_for

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
ENGINE_ARGS = dict(skip_tokenizer_init=True, enforce_eager=True, dtype="float32",
                   max_model_len=512, gpu_memory_utilization=0.5)
PROMPTS = [[1, 2, 3], [7, 8, 9, 10], [42]]


def save_qwen3(path, seed, max_positions=512):
    """A tiny random Qwen3 (head_dim 32: CPU attention refuses 16) saved as safetensors;
    returns the transformers model (the trainer's copy)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=1024, hidden_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                         intermediate_size=256, tie_word_embeddings=False,
                         max_position_embeddings=max_positions, torch_dtype="float32")
    model = Qwen3ForCausalLM(config).eval()
    model.save_pretrained(path)
    return model


class LoopThread:
    """An asyncio loop on a thread of its own; `run(coro)` waits for a result."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout=300):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


class InProcessVLLM:
    """An AsyncLLM serving `model_dir` with wtransfer backend `backend` (None: none)."""

    def __init__(self, model_dir, backend=None, staged=False, **engine_args):
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        self.thread = LoopThread()
        extra = wtransfer_vllm.engine_kwargs(backend, staged=staged) if backend else {}

        async def start():
            return AsyncLLM.from_engine_args(AsyncEngineArgs(
                model=str(model_dir), **{**ENGINE_ARGS, **extra, **engine_args}))

        self.llm = self.thread.run(start())
        self.client = (wtransfer_vllm.AsyncLLMClient(self.llm, loop=self.thread.loop)
                       if backend else None)

    async def _generate(self, prompt, max_tokens, request_id, started=None, after_tokens=0,
                        lora_request=None):
        from vllm import SamplingParams

        last = None
        async for out in self.llm.generate({"prompt_token_ids": prompt},
                                           SamplingParams(max_tokens=max_tokens, temperature=0),
                                           request_id=request_id, lora_request=lora_request):
            last = out
            if started is not None and len(out.outputs[0].token_ids) >= after_tokens:
                started.set()
        return last.outputs[0]

    def greedy(self, prompts=PROMPTS, max_tokens=12, lora_request=None):
        """Greedy tokens of each prompt (with the adapter of `lora_request`, if given)."""
        async def all_of_them():
            outs = await asyncio.gather(*[self._generate(p, max_tokens, f"g{time.monotonic_ns()}"
                                                         f"-{i}", lora_request=lora_request)
                                          for i, p in enumerate(prompts)])
            return [list(o.token_ids) for o in outs]

        return self.thread.run(all_of_them())

    def start_request(self, prompt, max_tokens, request_id, started, after_tokens):
        """Start one greedy request in the background; `started` (a threading.Event) is set
        once it produced `after_tokens` tokens. Returns its concurrent future."""
        return asyncio.run_coroutine_threadsafe(
            self._generate(prompt, max_tokens, request_id, started, after_tokens),
            self.thread.loop)

    def start_coroutine(self, coro):
        """Run `coro` on the engine's loop in the background; its concurrent future."""
        return asyncio.run_coroutine_threadsafe(coro, self.thread.loop)

    def call(self, coro_fn, *args, **kwargs):
        """Run an AsyncLLM coroutine method on the engine's loop."""
        return self.thread.run(coro_fn(*args, **kwargs))

    def close(self):
        self.llm.shutdown()
        self.thread.stop()


class VLLMServer:
    """`vllm serve` (dev mode: weight-transfer routes) with a wtransfer backend."""

    def __init__(self, model_dir, backend, log_path, extra_args=(), env=None, staged=False):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
               **(env or {})}
        self.log = open(log_path, "w")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            # the `vllm serve` command of vllm-cpu 0.32.0 looks for a distribution called
            # "vllm" and fails; the server's module runs the same server
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
             str(model_dir), "--port", str(self.port), "--skip-tokenizer-init", "--enforce-eager",
             "--dtype", "float32", "--max-model-len", "512", "--enable-scale-out",
             "--weight-transfer-config",
             json.dumps({"backend": wtransfer_vllm.vllm_backend_name(backend, staged=staged)}),
             "--worker-extension-cls", wtransfer_vllm.WORKER_EXTENSION, *extra_args],
            env=env, stdout=self.log, stderr=subprocess.STDOUT)
        def healthy():
            assert self.proc.poll() is None, log_path.read_text()[-3000:]
            try:
                return httpx.get(self.url + "/health", timeout=2).status_code == 200
            except httpx.TransportError:
                return False

        wait_for(healthy, 300, "vllm serve to start", interval_s=0.5)
        self.client = wtransfer_vllm.ServerClient(self.url, timeout_s=120)

    def greedy(self, prompts=PROMPTS, max_tokens=12, lora=None):
        """Greedy tokens of each prompt through /inference/v1/generate (with adapter `lora`)."""
        tokens = []
        for prompt in prompts:
            body = self.client.generate(prompt, lora=lora, max_tokens=max_tokens, temperature=0)
            tokens.append(list(body["choices"][0]["token_ids"]))
        return tokens

    def close(self):
        self.client.close()
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def init_info(backend, **fields):
    """The trainer init info for `backend` (nccl: a fresh rendezvous port)."""
    if backend == "nccl":
        from wtransfer_nccl import NCCLTrainerInitInfo

        return NCCLTrainerInitInfo(**{"master_address": "127.0.0.1", "world_size": 2,
                                      "timeout_s": 60, **fields})
    from wtransfer_ipc import IPCTrainerInitInfo

    return IPCTrainerInitInfo(**{"timeout_s": 60, **fields})


def send(backend, client, model, version, **fields):
    """One complete update of `model`'s weights; returns the transfer stats."""
    with wtransfer.trainer_init(init_info(backend, bucket_bytes=64 << 10, **fields),
                                client=client, source=wtransfer.ModuleSource(model)) as sender:
        return sender.send_weights(weight_version=version)
