"""The ipc receiver's view of its trainer's process (pid plus start time)."""

import subprocess
import sys

from wtransfer_ipc.sender_process import ProcessWatch, start_time


def test_a_watched_process_is_gone_once_it_exits_and_a_mismatched_one_never_is():
    """A real child process: watched while it runs, gone after it exits. A watch whose start
    time does not match what the engine sees (another pid namespace, a reused pid) stays inert:
    it must never fail a healthy update."""
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE)
    try:
        started = start_time(child.pid)
        assert started is not None
        watch = ProcessWatch(child.pid, started)
        mismatched = ProcessWatch(child.pid, started + 1)
        unnamed = ProcessWatch(child.pid, None)
        assert watch.active and not watch.gone()
        assert not mismatched.active and not unnamed.active
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait(timeout=30)
    assert watch.gone()
    assert not mismatched.gone() and not unnamed.gone()
