"""`TransferLane`'s finish: a commit that reaches a step boundary late but is already running
when the finish's deadline passes is waited for (its outcome is the update's), so no later
call starts staging into the shadow while it swaps; one that never began is cancelled."""

import threading
import time
from concurrent.futures import Future

import pytest

from wtransfer.errors import TransferTimeout
from wtransfer.inference.updates.transfer_lane import TransferLane


class StagedReplica:
    """The two calls a finish makes on a staging replica, recorded in order."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def finish_staged(self, version):
        self.calls.append(f"checked {version}")

    def commit_staged(self, version):
        time.sleep(0.3)  # (a commit that outlasts the finish's deadline)
        self.calls.append(f"committed {version}")


def boundary_at(delay_s, started):
    """A step loop that reaches its next boundary `delay_s` from now and runs the commit."""
    def at_step_boundary(commit):
        future: Future = Future()

        def step_loop():
            time.sleep(delay_s)
            if future.set_running_or_notify_cancel():
                started.set()
                future.set_result(commit())
        threading.Thread(target=step_loop, daemon=True).start()
        return future
    return at_step_boundary


def test_a_commit_running_past_the_deadline_is_waited_for_and_the_next_call_follows_it():
    replica, started = StagedReplica(), threading.Event()
    lane = TransferLane(replica, lambda command, args: replica.calls.append(command),
                        boundary_at(0.0, started), timeout_s=0.2)
    try:
        finish = lane.submit("finish_weight_update", ["v1"])
        following = lane.submit("start_weight_update", [])
        finish.result(timeout=10)  # committed, late: no error
        following.result(timeout=10)
        assert replica.calls == ["checked v1", "committed v1", "start_weight_update"]
    finally:
        lane.shutdown()


def test_a_commit_that_never_reached_a_step_boundary_is_cancelled_with_a_timeout():
    replica, started = StagedReplica(), threading.Event()
    lane = TransferLane(replica, lambda command, args: replica.calls.append(command),
                        boundary_at(1.0, started), timeout_s=0.2)
    try:
        with pytest.raises(TransferTimeout, match=r"did not reach a step boundary within 0\.2s"):
            lane.submit("finish_weight_update", ["v1"]).result(timeout=10)
        time.sleep(1.2)
        assert not started.is_set() and replica.calls == ["checked v1"]
    finally:
        lane.shutdown()
