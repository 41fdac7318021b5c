"""`CAPTURING`: one CUDA-graph capture at a time in a process. The engine's decode graphs and
a receiver's copy graphs capture on threads of their own; torch's capture bookkeeping (the
CUDA generators' graph state) is not made for two captures at once."""

import threading

CAPTURING = threading.Lock()
"""Held for the whole of each capture (and its warm-up)."""
