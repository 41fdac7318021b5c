"""`TransferLane`'s finish: a commit that reaches a step boundary late but is already running
when the finish's deadline passes is waited for (its outcome is the update's), so no later
call starts staging into the shadow while it swaps; one that never began is cancelled."""

import threading
from concurrent.futures import Future, wait

import pytest

from wtransfer.errors import TransferTimeout
from wtransfer.inference.updates.transfer_lane import TransferLane

DEADLINE_S = 10.0
"""How long a test waits for anything it expects to happen."""


class StagedReplica:
    """The two calls a finish makes on a staging replica, recorded in order; the commit
    runs until `release` is set."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.release = threading.Event()

    def finish_staged(self, version):
        self.calls.append(f"checked {version}")

    def commit_staged(self, version):
        assert self.release.wait(DEADLINE_S)
        self.calls.append(f"committed {version}")


class StepLoop:
    """A step loop that reaches its next boundary once `reach` is set, and runs the commit
    handed to it there (unless it was cancelled)."""

    def __init__(self) -> None:
        self.reach = threading.Event()
        self.started = threading.Event()
        self.thread: threading.Thread | None = None

    def at_step_boundary(self, commit):
        future: Future = Future()

        def loop():
            assert self.reach.wait(DEADLINE_S)
            if future.set_running_or_notify_cancel():
                self.started.set()
                future.set_result(commit())
        self.thread = threading.Thread(target=loop, daemon=True)
        self.thread.start()
        return future


def test_a_commit_running_past_the_deadline_is_waited_for_and_the_next_call_follows_it():
    replica, steps = StagedReplica(), StepLoop()
    steps.reach.set()
    lane = TransferLane(replica, lambda command, args: replica.calls.append(command),
                        steps.at_step_boundary, timeout_s=1.0)
    try:
        finish = lane.submit("finish_weight_update", ["v1"])
        following = lane.submit("start_weight_update", [])
        assert steps.started.wait(DEADLINE_S)
        done, _ = wait([finish], timeout=1.4)  # past its 1 s deadline, before a second one:
        # still waiting on the commit
        assert not done and replica.calls == ["checked v1"]
        replica.release.set()
        finish.result(timeout=DEADLINE_S)  # committed, late: no error
        following.result(timeout=DEADLINE_S)
        assert replica.calls == ["checked v1", "committed v1", "start_weight_update"]
    finally:
        replica.release.set()
        lane.shutdown()


def test_a_commit_that_never_reached_a_step_boundary_is_cancelled_with_a_timeout():
    replica, steps = StagedReplica(), StepLoop()
    replica.release.set()
    lane = TransferLane(replica, lambda command, args: replica.calls.append(command),
                        steps.at_step_boundary, timeout_s=0.2)
    try:
        with pytest.raises(TransferTimeout, match=r"did not reach a step boundary within 0\.2s"):
            lane.submit("finish_weight_update", ["v1"]).result(timeout=DEADLINE_S)
        steps.reach.set()  # the boundary comes after all: the cancelled commit does not run
        assert steps.thread is not None
        steps.thread.join(DEADLINE_S)
        assert not steps.thread.is_alive()
        assert not steps.started.is_set() and replica.calls == ["checked v1"]
    finally:
        steps.reach.set()
        lane.shutdown()
