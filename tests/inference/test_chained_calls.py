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
from wtransfer.inference.commands import Chain, chained

DEADLINE_S = 30


class Recorder:
    """Runs named commands on a real worker thread, recording what was submitted and what
    ran, in order; "fail" raises."""

    def __init__(self) -> None:
        self.submitted: list[str] = []
        self.ran: list[str] = []
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="recorder")

    def submit(self, command, *args):
        self.submitted.append(command)

        def work():
            self.ran.append(command)
            if command == "fail":
                raise LifecycleError("refused on purpose")
            return command.upper()
        return self.pool.submit(work)


def test_each_command_runs_after_the_one_it_names_and_only_if_that_succeeded():
    recorder = Recorder()
    futures = Chain(recorder.submit, [("a", (), None), ("fail", (), 0), ("b", (), 1),
                                      ("c", (), 2), ("d", (), None), ("e", (), 4)]).futures
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


def test_a_stopped_chain_runs_nothing_more():
    """`stop` while the first command waits at a busy engine: it is cancelled there, and
    nothing behind it is submitted; each future says why it never ran."""
    recorder = Recorder()
    gate = threading.Event()
    held = recorder.pool.submit(gate.wait, DEADLINE_S)  # the engine is busy
    run_ = Chain(recorder.submit, [("a", (), None), ("b", (), 0), ("c", (), None)])
    run_.stop("a test stopped it")
    for future, message in zip(run_.futures, ("a never ran: it was cancelled before it "
                                              "started", "b never ran: a test stopped it",
                                              "c never ran: a test stopped it"), strict=True):
        with pytest.raises(LifecycleError, match=message):
            future.result(DEADLINE_S)
    gate.set()
    assert held.result(DEADLINE_S)
    recorder.pool.shutdown(wait=True)
    assert recorder.submitted == ["a"] and recorder.ran == []


def test_a_command_past_its_deadline_and_those_behind_it_never_run():
    """`chained`: a command still queued at its deadline is a `TransferTimeout`, nothing
    behind it is submitted (whether it names it as `after` or not), and it never runs."""
    recorder = Recorder()
    gate = threading.Event()
    recorder.pool.submit(gate.wait, DEADLINE_S)  # the engine is busy past the deadline

    async def answers():
        return [a async for a in chained(recorder.submit, [("a", (), None), ("b", (), 0),
                                                           ("c", (), None)], 0.2)]

    got = run(answers())
    assert isinstance(got[0], TransferTimeout) and "a did not complete within 0.2s" in str(
        got[0])
    assert all(isinstance(a, LifecycleError) and "never ran" in str(a) for a in got[1:])
    gate.set()
    recorder.pool.shutdown(wait=True)
    assert recorder.submitted == ["a"] and recorder.ran == []


def test_a_command_that_cannot_be_stopped_reports_its_own_outcome():
    """An engine future that is running from the start (a data-parallel engine's: the ranks
    have it) cannot be cancelled: past its deadline its answer says it may still complete,
    and nothing behind it runs."""
    submitted: list[str] = []
    sent: Future = Future()
    sent.set_running_or_notify_cancel()

    def submit(command, *args):
        submitted.append(command)
        return sent

    async def answers():
        run_ = chained(submit, [("a", (), None), ("b", (), None)], 0.1)
        return [a async for a in run_]

    got = run(answers())
    assert isinstance(got[0], TransferTimeout) and "may still complete" in str(got[0])
    assert isinstance(got[1], LifecycleError) and "b never ran" in str(got[1])
    sent.set_result("done at last")
    assert submitted == ["a"]


def test_a_reader_that_goes_away_stops_the_commands_not_yet_submitted():
    submitted: list[str] = []
    first: Future = Future()
    first.set_running_or_notify_cancel()  # (the engine started it: it completes below)

    def submit(command, *args):
        submitted.append(command)
        if command != "a":
            done = Future()
            done.set_result(command)
            return done
        return first

    async def first_then_leave():
        answers = chained(submit, [("a", (), None), ("b", (), 0)], DEADLINE_S)
        waiting = asyncio.ensure_future(answers.__anext__())
        await asyncio.sleep(0)
        waiting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await waiting
        await answers.aclose()  # (as the server closes it when its client disconnects)

    run(first_then_leave())
    first.set_result("a")  # "a" completes now: its callbacks run here, "b" stays unsent
    assert submitted == ["a"]


def test_an_engine_runs_a_chain_longer_than_one_gap_takes():
    """More chained commands than one gap runs (`CHAINED_PER_GAP`): the rest wait for the
    next gap, none is lost."""

    async def main():
        engine = AsyncEngine(EngineConfig(model="tiny", seed=0))
        try:
            futures = Chain(engine.core.submit, [("is_paused", (), None)] * 200).futures
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
    futures = Chain(submit, commands).futures
    assert [f.result(0) for f in futures[:5000]] == ["c"] * 5000
    with pytest.raises(LifecycleError, match="dropped never ran: it was cancelled before"):
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
                futures = Chain(engine.core.submit, [("stats", (), None)] * 3).futures
                counts = [(await asyncio.wrap_future(f))["tokens_generated"] for f in futures]
                assert len(set(counts)) == 1, counts
            with pytest.raises(ConfigError, match="is_paused is not a weight-sync call"):
                async for _ in engine.run_calls([("is_paused", (), None)]):
                    pass
            task.cancel()
        finally:
            engine.shutdown()

    run(main())
