"""Chained commands (`wtransfer.inference.commands.chain`): a batch of calls runs in order, each
only after the one it names succeeded, and on an engine that is generating they all run
between the same two steps instead of one step apart."""

import asyncio
import contextlib
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
from engine_helpers import collect, run

from wtransfer.errors import ConfigError, LifecycleError, TransferTimeout
from wtransfer.inference import AsyncEngine, EngineConfig, SamplingParams
from wtransfer.inference.commands import chain, chained

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


def test_a_command_past_its_deadline_and_those_behind_it_never_run():
    """`chained`: a command still queued at its deadline is a `TransferTimeout`, the one
    behind it is skipped, and neither runs once the engine gets to them."""
    recorder = Recorder()
    gate = threading.Event()
    recorder.pool.submit(gate.wait, DEADLINE_S)  # the engine is busy past the deadline

    async def answers():
        return [a async for a in chained(recorder.submit, [("a", (), None), ("b", (), 0),
                                                           ("c", (), None)], 0.2)]

    got = run(answers())
    assert isinstance(got[0], TransferTimeout) and "a did not complete within 0.2s" in str(
        got[0])
    assert all(isinstance(a, LifecycleError) and "skipped" in str(a) for a in got[1:])
    gate.set()
    recorder.pool.shutdown(wait=True)
    assert recorder.ran == []


def test_a_reader_that_goes_away_stops_the_commands_not_yet_run():
    recorder = Recorder()
    gate = threading.Event()

    def submit(command, *args):
        if command == "a":
            return recorder.pool.submit(gate.wait, DEADLINE_S)
        return recorder.submit(command, *args)

    async def first_then_leave():
        answers = chained(submit, [("a", (), None), ("b", (), 0)], DEADLINE_S)
        waiting = asyncio.ensure_future(answers.__anext__())
        await asyncio.sleep(0.05)
        waiting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await waiting
        await answers.aclose()  # (as the server closes it when its client disconnects)

    run(first_then_leave())
    gate.set()
    recorder.pool.shutdown(wait=True)
    assert recorder.ran == []  # "b" never ran


def test_an_engine_runs_a_chain_longer_than_one_gap_takes():
    """More chained commands than one gap runs (`CHAINED_PER_GAP`): the rest wait for the
    next gap, none is lost."""

    async def main():
        engine = AsyncEngine(EngineConfig(model="tiny", seed=0))
        try:
            futures = chain(engine.core.submit, [("is_paused", (), None)] * 200)
            return [await asyncio.wait_for(asyncio.wrap_future(f), DEADLINE_S)
                    for f in futures]
        finally:
            engine.shutdown()

    assert run(main()) == [False] * 200


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
    with pytest.raises(LifecycleError, match="dropped was cancelled before it ran"):
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
