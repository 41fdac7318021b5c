"""Data parallelism: one front end over N engine-core processes stepping in lockstep.

`DataParallelCore` (the front end, in the `AsyncEngine` process) routes each request to the rank
with the fewest outstanding requests and sends pause, resume and every weight-transfer call to
all ranks. Each rank (`wtransfer.inference.dp.rank`, its own process) runs one `Replica` and
joins a gloo all-reduce on every step of a wave; see `rank.py` for the two-phase pause.
"""

from wtransfer.inference.dp.frontend import DataParallelCore

__all__ = ["DataParallelCore"]
