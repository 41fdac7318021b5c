"""`StallMeter`: how long an update kept the engine from stepping (`update_stall_ms`).

An update's window opens when it starts and closes at the first step after it finished (an
in-place update: after the resume; a staged one: after its commit). The stall is the longest
gap between two consecutive step ends inside the window, counted only where the engine had
requests to step at the earlier one (an idle engine does not stall). A paused update's gap
therefore spans its pause; a staged one's only the steps slowed beside the transfer and the
step that carries the commit. A step's own compute is part of every gap: compare against the
step interval without updates (`benchmarks/stall.py` prints both).
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

    def step(self, busy: bool) -> None:
        """A step ended; `busy`: the engine has requests left to step."""
        now = time.monotonic()
        if self._open and self._busy and self._last_end is not None:
            self._worst = max(self._worst, now - self._last_end)
        if self._closing:
            self.last_ms = self._worst * 1e3
            self._open = self._closing = False
        self._last_end, self._busy = now, busy
