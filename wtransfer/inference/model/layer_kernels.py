"""Where the model's layers run Triton kernels instead of their eager code (CUDA, where Triton
imports): the fused RMSNorm and rotation (`wtransfer.inference.model.fused`) outside autograd
unless the environment says `WTRANSFER_FUSED_LAYERS=0` (benchmarks compare both), and decode
attention over the paged cache (`wtransfer.inference.model.paged_decode`) where the engine asks
for it (`EngineConfig.paged_attention`). Each is tried once per device and dtype on a small
input against the eager result; one that fails there (no compiler, a PTX error, wrong values)
is not used, with a warning, and the eager code runs instead."""

from __future__ import annotations

import functools
import importlib
import logging
import os
import threading
from collections.abc import Callable
from types import ModuleType

import torch
import torch.nn.functional as F

from wtransfer.inference.model.eager_ops import rms_norm_eager, rotate_eager

log = logging.getLogger(__name__)

_lock = threading.Lock()
_tried: dict[tuple[str, torch.device, torch.dtype], bool] = {}


@functools.cache
def _kernels(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(f"wtransfer.inference.model.{name}")
    except Exception as exc:  # (no Triton, or one that cannot load: the eager code)
        log.debug("Triton kernels %s unavailable: %s", name, exc)
        return None


def _works(name: str, device: torch.device, dtype: torch.dtype,
           trial: Callable[[ModuleType, torch.device, torch.dtype], bool]) -> ModuleType | None:
    """Module `name` where `trial` passed on `device` and `dtype` (tried once), else None."""
    module = _kernels(name)
    if module is None:
        return None
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (name, device, dtype)
    known = _tried.get(key)  # (every call after the first: no lock)
    if known is not None:
        return module if known else None
    with _lock:
        if key not in _tried:
            try:
                with torch.no_grad(), torch.cuda.device(device):
                    _tried[key] = trial(module, device, dtype)
            except Exception as exc:
                log.warning("Triton kernels %s fail on %s for %s, the eager code runs "
                            "instead: %s: %s", name, device, dtype, type(exc).__name__, exc)
                _tried[key] = False
            else:
                if not _tried[key]:
                    log.warning("Triton kernels %s give wrong values on %s for %s, the eager "
                                "code runs instead", name, device, dtype)
        return module if _tried[key] else None


def _try_fused(module: ModuleType, device: torch.device, dtype: torch.dtype) -> bool:
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(3, 4, 64, device=device, generator=gen).to(dtype)
    weight = torch.randn(64, device=device, generator=gen).to(dtype)
    angles = torch.rand(3, 1, 32, device=device, generator=gen).repeat(1, 1, 2)
    cos, sin = angles.cos(), angles.sin()
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    return (torch.allclose(module.rms_norm(x, weight, 1e-6).float(),
                           rms_norm_eager(x, weight, 1e-6).float(), rtol=tolerance,
                           atol=tolerance)
            and torch.allclose(module.rotate(x, cos, sin).float(),
                               rotate_eager(x, cos, sin).float(), rtol=tolerance,
                               atol=tolerance))


def _try_paged(module: ModuleType, device: torch.device, dtype: torch.dtype) -> bool:
    gen = torch.Generator(device=device).manual_seed(0)
    k, v = (torch.randn(64, 2, 64, device=device, generator=gen).to(dtype) for _ in range(2))
    q = torch.randn(2, 4, 64, device=device, generator=gen).to(dtype)
    tables = torch.tensor([[3, 0], [1, 2]], device=device)
    lengths = torch.tensor([20, 5], device=device)
    out = module.paged_decode(q, k, v, tables, lengths, 16)
    for b, slots in enumerate([torch.cat([torch.arange(48, 64), torch.arange(0, 4)]),
                               torch.arange(16, 21)]):
        keys, values = (c[slots.to(device)].float().transpose(0, 1) for c in (k, v))
        want = F.scaled_dot_product_attention(q[b].float().view(2, 2, 64), keys, values)
        if not torch.allclose(out[b].float(), want.reshape(4, 64), rtol=2e-2, atol=2e-2):
            return False
    return True


def fused_for(x: torch.Tensor) -> ModuleType | None:
    """The fused kernels' module where they apply to `x`, else None."""
    if (x.device.type != "cuda" or torch.is_grad_enabled()
            or os.environ.get("WTRANSFER_FUSED_LAYERS", "1") == "0"):
        return None
    return _works("fused", x.device, x.dtype, _try_fused)


def paged_decode_for(device: torch.device, head_dim: int, dtype: torch.dtype
                     ) -> ModuleType | None:
    """The paged decode kernel's module where it takes heads of `head_dim` values in `dtype`
    on `device`, else None."""
    if device.type != "cuda":
        return None
    module = _kernels("paged_decode")
    if module is None or not module.supports(head_dim, dtype):
        return None
    return _works("paged_decode", device, dtype, _try_paged)

