"""Helpers shared by the inference-engine tests (single-process and data-parallel)."""

import asyncio
import importlib
import time

import pytest
import torch

from wtransfer.inference import SamplingParams

GREEDY = SamplingParams(max_tokens=24, temperature=0.0)
DEADLINE_S = 120


def run(coro, deadline_s=DEADLINE_S):
    """Run `coro` to completion under a deadline: a deadlock fails the test, never hangs CI."""
    return asyncio.run(asyncio.wait_for(coro, deadline_s))


async def until(predicate, what="the condition", timeout=30.0):
    """Poll `predicate` (on the event loop) until true; fail naming `what` after `timeout`."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.002)


async def collect(engine, rid, prompt, params=GREEDY, progress=None):
    """Run one request to the end; record its token count in `progress` as it streams."""
    last = None
    async for out in engine.generate(prompt, params, request_id=rid):
        last = out
        if progress is not None:
            progress[rid] = len(out.outputs[0].token_ids)
    return last


async def tokens_of(engine, prompts, params=GREEDY):
    """Each prompt's tokens from `engine` ({request id: prompt}), every request at once."""
    outs = await asyncio.gather(*(collect(engine, rid, p, params) for rid, p in prompts.items()))
    return {rid: o.outputs[0].token_ids for rid, o in zip(prompts, outs, strict=True)}


def triton_kernels(name):
    """`wtransfer.inference.model.<name>` (a module of Triton kernels), or skip the test where
    there is no CUDA device or no Triton."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("triton", reason=f"{name} holds Triton kernels")
    return importlib.import_module(f"wtransfer.inference.model.{name}")
