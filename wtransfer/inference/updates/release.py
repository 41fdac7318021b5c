"""Giving an engine's memory back at shutdown (weights, shadow, KV cache), so that a process
can create and shut down engines one after another on one device."""

from __future__ import annotations

import gc

import torch
from torch import nn


def release_module(module: nn.Module) -> None:
    """Drop the storage of every parameter and buffer of `module` (each becomes an empty
    tensor of its dtype on its device); the module must not run again."""
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            tensor.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)


def return_device_memory(device: torch.device | str) -> None:
    """Collect what is unreachable and hand the CUDA allocator's cached blocks back to the
    device (nothing more to do on the host)."""
    gc.collect()
    if torch.device(device).type == "cuda" and torch.cuda.is_available():
        torch.cuda.empty_cache()
