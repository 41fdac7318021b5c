"""`DeadlineTimer`: one thread that calls a function once a deadline passes, unless re-armed.

The receiver base arms it after every call of an open update (the sender's next call is due
within `timeout_s`, or sooner where the backend can ask whether its sender is gone), so an
engine never waits forever on a trainer that died. Distinct from the two ways a backend
learns its sender is gone: `wtransfer.transport.tcp_lifeline` (a TCP connection the trainer's
kernel resets when it dies) and `wtransfer_ipc.sender_process` (the trainer's process, named
by pid and start time).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class DeadlineTimer:
    """Calls `expire()` once `deadline` (monotonic seconds) passes, unless disarmed first.

    One daemon thread per timer, started on the first `arm`; `close` stops it.
    """

    def __init__(self, expire: Callable[[], None], name: str) -> None:
        self._expire = expire
        self._name = name
        self._deadline: float | None = None
        self._sleeping_until: float | None = None
        """The deadline the thread sleeps towards (None: until notified). Only an earlier
        deadline wakes it: every engine call arms and disarms, and waking a thread for
        nothing costs the caller a GIL hand-off."""
        self._closed = False
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def arm(self, deadline: float) -> None:
        """Fire at `deadline` unless re-armed or disarmed before."""
        with self._cond:
            self._deadline = deadline
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            if self._sleeping_until is None or deadline < self._sleeping_until:
                self._cond.notify()

    def disarm(self) -> None:
        """Do not fire (the thread finds no deadline when it next wakes)."""
        with self._cond:
            self._deadline = None

    def close(self) -> None:
        """Stop the thread (it never fires afterwards)."""
        with self._cond:
            self._closed = True
            self._deadline = None
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closed and (self._deadline is None
                                            or time.monotonic() < self._deadline):
                    self._sleeping_until = self._deadline
                    wait = None if self._deadline is None else self._deadline - time.monotonic()
                    self._cond.wait(wait)
                self._sleeping_until = None
                if self._closed:
                    return
                self._deadline = None
            self._expire()
