"""Every thread's stack on demand: `kill -USR1 PID` prints them to the process's stderr.

Long-lived wtransfer processes (the `wtransfer` command, engine workers, trainer ranks) call
`print_stacks_on_sigusr1()` at start, so a transfer that seems stuck can be looked into
without a debugger or restarting it.
"""

from __future__ import annotations

import faulthandler
import signal
import sys


def print_stacks_on_sigusr1() -> None:
    """Let SIGUSR1 print every thread's Python stack to stderr (the process keeps running)."""
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True, chain=False)
