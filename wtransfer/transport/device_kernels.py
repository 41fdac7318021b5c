"""Triton kernels used on a CUDA device only after a probe there gave the eager ops' results,
checked once per device; an environment variable turns a family of them off."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from types import ModuleType

import torch


class CheckedKernels:
    """One family of kernels (a module): `on(device)` is the module where its probe passed on
    that device and `env` is not "0", else None (the caller runs its eager ops)."""

    def __init__(self, env: str, check: Callable[[torch.device], ModuleType | None]) -> None:
        self.env = env
        self._check = check
        self._by_device: dict[torch.device, ModuleType | None] = {}
        self._lock = threading.Lock()

    def on(self, device: torch.device) -> ModuleType | None:
        """The kernels for `device` (probed on first use there), or None."""
        if device.type != "cuda" or os.environ.get(self.env, "1") == "0":
            return None
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        with self._lock:
            if device not in self._by_device:
                self._by_device[device] = self._check(device)
            return self._by_device[device]

    def drop(self, device: torch.device) -> None:
        """Eager ops on `device` from now on (the kernels failed there after their probe)."""
        with self._lock:
            self._by_device[device] = None
