"""Whether the trainer process is still there, seen from an engine on the same machine.

A process is named by its pid and its start time (clock ticks since boot, from
``/proc/<pid>/stat``): a pid the kernel reuses for another process does not pass for it. An
engine in another pid namespace does not see the trainer's pid (or sees an unrelated process
under it); it then never concludes the trainer is gone.
"""

from __future__ import annotations

import os


def start_time(pid: int) -> int | None:
    """When process `pid` started (clock ticks since boot), or None when there is none."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    try:  # the command name may hold spaces and parentheses: fields follow the last ')'
        return int(stat[stat.rindex(b")") + 2 :].split()[19])
    except (ValueError, IndexError):
        return None


def own_start_time() -> int | None:
    """This process's start time (see `start_time`)."""
    return start_time(os.getpid())


class ProcessWatch:
    """Watches one process named by pid and start time; tells when it is gone. Inert when the
    process was not visible with that start time to begin with (another pid namespace, no
    ``/proc``, no start time given)."""

    def __init__(self, pid: int, started: int | None) -> None:
        self.pid = pid
        self._started = started if started is not None and start_time(pid) == started \
            else None

    @property
    def active(self) -> bool:
        """Whether this watch can tell (the process was visible when it began)."""
        return self._started is not None

    def gone(self) -> bool:
        """True once the watched process exited (never for an inert watch)."""
        return self._started is not None and start_time(self.pid) != self._started
