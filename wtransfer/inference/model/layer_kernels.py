"""Where the model's layers run Triton kernels instead of their eager chains (CUDA, where
Triton imports): the fused RMSNorm and rotation (`wtransfer.inference.model.fused`) outside
autograd unless the environment says `WTRANSFER_FUSED_LAYERS=0` (benchmarks compare both), and
decode attention over the paged cache (`wtransfer.inference.model.paged_decode`) where the
engine asks for it (`EngineConfig.paged_attention`)."""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
from contextlib import AbstractContextManager
from types import ModuleType

import torch


@functools.cache
def _kernels(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(f"wtransfer.inference.model.{name}")
    except ImportError:  # (no Triton: the eager code)
        return None


def fused_for(x: torch.Tensor) -> ModuleType | None:
    """The fused kernels' module where they apply to `x`, else None."""
    if (x.device.type != "cuda" or torch.is_grad_enabled()
            or os.environ.get("WTRANSFER_FUSED_LAYERS", "1") == "0"):
        return None
    return _kernels("fused")


def paged_decode_for(device: torch.device, head_dim: int, dtype: torch.dtype
                     ) -> ModuleType | None:
    """The paged decode kernel's module where it takes heads of `head_dim` values in `dtype`
    on `device`, else None."""
    if device.type != "cuda":
        return None
    module = _kernels("paged_decode")
    return module if module is not None and module.supports(head_dim, dtype) else None


def launching_on(x: torch.Tensor) -> AbstractContextManager[object]:
    """Make x's CUDA device current while a kernel is launched for it (the calling thread's
    may be another); on the host (Triton's interpreter, in tests) nothing."""
    return torch.cuda.device(x.device) if x.device.type == "cuda" else contextlib.nullcontext()
