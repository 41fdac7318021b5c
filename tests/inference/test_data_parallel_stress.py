"""Stress: 120 pause -> ipc update -> resume cycles on a 4-rank engine under continuous load,
with random pause timing and modes. Every cycle has its own deadline, so a deadlock fails the
test instead of hanging it; the summary (cycles, worst pause latency) is always printed."""

import asyncio
import itertools
import random
import statistics
import time

import pytest
import torch
from test_data_parallel import dp_engine, trainer_sender

import wtransfer
from wtransfer.inference import SamplingParams
from wtransfer.inference.model.decoder import load_model

CYCLES = 120
CYCLE_DEADLINE_S = 30
IN_FLIGHT = 6


def version_order(version):
    return -1 if version == "default" else int(version[1:])


def check_spans(out):
    """Spans cover the output without gaps, each version newer than the one before."""
    done = out.outputs[0]
    spans = done.weight_versions
    assert spans[0].start == 0 and spans[-1].end == len(done.token_ids), spans
    for before, after in itertools.pairwise(spans):
        assert before.end == after.start, spans
        assert version_order(before.version) < version_order(after.version), spans


@pytest.mark.stress
@pytest.mark.parametrize("size", [4])
def test_120_pause_update_resume_cycles_under_load_never_hang(size, capsys):
    rng = random.Random(7)

    async def main():
        engine = dp_engine(size)
        trainer = load_model("tiny", seed=1)
        sender = await asyncio.to_thread(trainer_sender, engine, trainer)
        finished, created, stop = [], [], asyncio.Event()

        async def one(i):
            params = SamplingParams(max_tokens=rng.randint(4, 40), temperature=1.0, seed=i)
            last = None
            prompt = [rng.randrange(256) for _ in range(rng.randint(1, 6))]
            async for out in engine.generate(prompt, params, request_id=f"q{i}"):
                last = out
            return last

        async def load():
            running, i = set(), 0
            while not stop.is_set() or running:
                while not stop.is_set() and len(running) < IN_FLIGHT:
                    running.add(asyncio.create_task(one(i)))
                    created.append(i)
                    i += 1
                done, running = await asyncio.wait(running, timeout=0.05,
                                                   return_when=asyncio.FIRST_COMPLETED)
                finished.extend(task.result() for task in done)

        def update(cycle):
            with torch.no_grad():
                for p in trainer.parameters():
                    p.add_(1e-3)
            sender.send_weights(weight_version=f"c{cycle}")

        async def cycle(i, pauses):
            await asyncio.sleep(rng.uniform(0, 0.015))
            mode = rng.choice(["keep", "keep", "abort", "wait"])
            start = time.perf_counter()
            await engine.pause_generation(mode=mode, clear_cache=rng.random() < 0.5)
            pauses.append((time.perf_counter() - start, mode))
            await asyncio.to_thread(update, i)
            await engine.resume_generation()

        loader = asyncio.create_task(load())
        pauses = []
        started = time.perf_counter()
        try:
            for i in range(CYCLES):
                await asyncio.wait_for(cycle(i, pauses), CYCLE_DEADLINE_S)
            stop.set()
            await asyncio.wait_for(loader, 60)
            assert await engine.fingerprint() == wtransfer.fingerprint(trainer.state_dict())
            assert await engine.get_weight_version() == f"c{CYCLES - 1}"
        finally:
            stop.set()
            sender.shutdown()
            engine.shutdown()
        seconds = time.perf_counter() - started

        assert len(pauses) == CYCLES
        assert len(finished) == len(created) and all(out.finished for out in finished)
        reasons = [out.outputs[0].finish_reason for out in finished]
        assert set(reasons) <= {"length", "stop", "abort"}, set(reasons)
        for out in finished:
            if out.outputs[0].token_ids:
                check_spans(out)
        straddled = sum(len({s.version for s in o.outputs[0].weight_versions}) > 1
                        for o in finished)
        no_abort = [t for t, mode in pauses if mode != "wait"]
        with capsys.disabled():
            print(f"\ndp stress: {len(pauses)} pause/update/resume cycles in {seconds:.1f}s, "
                  f"{size} ranks; pause latency (keep/abort) median "
                  f"{statistics.median(no_abort) * 1e3:.1f} ms, worst "
                  f"{max(no_abort) * 1e3:.1f} ms; worst including wait-mode drains "
                  f"{max(t for t, _ in pauses) * 1e3:.1f} ms; {len(finished)} requests "
                  f"finished ({reasons.count('abort')} aborted by abort-mode pauses, "
                  f"{straddled} straddled an update), none lost")

    asyncio.run(main())
