"""`StallMeter`: how long an update kept the engine from stepping (`update_stall_ms`).

An update's window opens when it starts and closes at the first step after it finished (an
in-place update: after the resume; a staged one: after its commit). The stall is the longest
time inside the window between the end of one step and the start of the next, counted only
where the engine had requests to step at the end of the earlier one (an idle engine does not
stall): the time the engine computed nothing because of the update. A paused update's stall
therefore spans its pause; a staged one's is the commit and the calls between two steps. Steps
that run slower beside a staged transfer, or the re-prefill after a commit, are compute, not
stall: they show in throughput (`benchmarks/stall.py` prints both).
"""

from __future__ import annotations

import time


class StallMeter:
    """Measures each update's stall (see the module docstring); used on the engine thread."""

    def __init__(self) -> None:
        self.last_ms: float | None = 0.0
        """The last update's stall, in milliseconds; None until its window closed (the first
        step after it finished)."""
        self._open = False
        self._closing = False
        self._worst = 0.0
        self._last_end: float | None = None
        self._busy = False

    def open(self) -> None:
        """An update started."""
        self._open, self._closing, self._worst, self.last_ms = True, False, 0.0, None

    def close(self) -> None:
        """The update finished: the next step ends its window."""
        if self._open:
            self._closing = True

    def step(self, started: float, busy: bool) -> None:
        """A step that began at `started` (`time.monotonic()`) ended; `busy`: the engine has
        requests left to step."""
        if self._open and self._busy and self._last_end is not None:
            self._worst = max(self._worst, started - self._last_end)
        if self._closing:
            self.last_ms = self._worst * 1e3
            self._open = self._closing = False
        self._last_end, self._busy = time.monotonic(), busy
