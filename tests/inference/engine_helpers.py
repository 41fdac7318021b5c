"""Helpers shared by the inference-engine tests (single-process and data-parallel)."""

import asyncio
import time

import pytest

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
