"""Chained commands (`wtransfer.inference.commands.chain`): a batch of calls runs in order, each
only after the one it names succeeded, and on an engine that is generating they all run
between the same two steps instead of one step apart."""

import asyncio
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
from engine_helpers import collect, run

from wtransfer.errors import ConfigError, LifecycleError
from wtransfer.inference import AsyncEngine, EngineConfig, SamplingParams
from wtransfer.inference.commands import chain

DEADLINE_S = 30


class Recorder:
    """Runs named commands on a real worker thread, recording their order; "fail" raises."""

    def __init__(self) -> None:
        self.ran: list[str] = []
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="recorder")

    def submit(self, command, *args):
        def work():
            self.ran.append(command)
            if command == "fail":
                raise LifecycleError("refused on purpose")
            return command.upper()
        return self.pool.submit(work)


def test_each_command_runs_after_the_one_it_names_and_only_if_that_succeeded():
    recorder = Recorder()
    futures = chain(recorder.submit, [("a", (), None), ("fail", (), 0), ("b", (), 1),
                                      ("c", (), 2), ("d", (), None), ("e", (), 4)])
    assert futures[-1].result(DEADLINE_S) == "E"
    assert recorder.ran == ["a", "fail", "d", "e"]  # b after the failure, c after b: skipped
    assert futures[0].result(0) == "A"
    with pytest.raises(LifecycleError, match="refused on purpose"):
        futures[1].result(0)
    with pytest.raises(LifecycleError, match="b skipped: it was to run after fail"):
        futures[2].result(0)
    with pytest.raises(LifecycleError, match="c skipped: it was to run after b"):
        futures[3].result(0)
    recorder.pool.shutdown()


def test_a_command_whose_waiter_gave_up_never_runs():
    recorder = Recorder()
    gate = threading.Event()
    held = recorder.pool.submit(gate.wait, DEADLINE_S)  # the worker is busy until released
    futures = chain(recorder.submit, [("a", (), None), ("b", (), 0), ("c", (), None)])
    assert futures[1].cancel()  # (not yet running: it is submitted once "a" completes)
    gate.set()
    assert futures[2].result(DEADLINE_S) == "C"
    assert held.result(0) and recorder.ran == ["a", "c"]
    recorder.pool.shutdown()


def test_a_long_chain_of_commands_done_at_once_and_one_the_engine_cancelled():
    """A submit whose futures are already done (a dead engine's are) settles the whole chain
    in a loop, not a recursion; a command the engine cancelled fails, and what names it as
    `after` is skipped."""

    def submit(command, *args):
        done = Future()
        if command == "dropped":
            done.cancel()
        else:
            done.set_result(command)
        return done

    commands = [("c", (), None)] * 5000 + [("dropped", (), None), ("after", (), 5000)]
    futures = chain(submit, commands)
    assert [f.result(0) for f in futures[:5000]] == ["c"] * 5000
    with pytest.raises(LifecycleError, match="dropped was cancelled"):
        futures[5000].result(0)
    with pytest.raises(LifecycleError, match="after skipped: it was to run after dropped"):
        futures[5001].result(0)


def test_a_generating_engine_runs_a_whole_chain_between_two_steps():
    """Three chained `stats` calls while a request streams: each sees the same number of
    tokens generated (no step ran between them; unchained, each waits for the next gap)."""

    async def main():
        engine = AsyncEngine(EngineConfig(model="tiny", seed=0))
        try:
            params = SamplingParams(max_tokens=1000, temperature=0.0)
            progress: dict[str, int] = {}
            task = asyncio.create_task(collect(engine, "long", [1, 2, 3], params, progress))
            while progress.get("long", 0) < 8:
                await asyncio.sleep(0.005)
            for _ in range(5):
                futures = chain(engine.core.submit, [("stats", (), None)] * 3)
                counts = [(await asyncio.wrap_future(f))["tokens_generated"] for f in futures]
                assert len(set(counts)) == 1, counts
            with pytest.raises(ConfigError, match="is_paused is not a weight-sync call"):
                async for _ in engine.run_calls([("is_paused", (), None)]):
                    pass
            task.cancel()
        finally:
            engine.shutdown()

    run(main())
