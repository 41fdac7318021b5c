"""`FiniteCheck`: the values an update brings, watched for NaN and infinity before it goes live.

One reduction per tensor (its smallest and largest value, which NaN and infinity both
reach) as the bytes land. On the host each verdict is read at once; on CUDA the reductions
stay on the device, queued behind the copies, and one read at the update's finish names the
first tensor that held a non-finite value.
"""

from __future__ import annotations

import torch

_ONE_BYTE_FLOATS = {dt for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                                    "float8_e5m2fnuz") if (dt := getattr(torch, name, None))}


def extremes(values: torch.Tensor) -> torch.Tensor:
    """The smallest and largest element of a non-empty floating-point tensor (NaN if any
    element is NaN), as a 2-element tensor on its device."""
    if values.dtype in _ONE_BYTE_FLOATS:
        values = values.to(torch.float16)  # NaN stays NaN; reductions lack FP8 kernels
    low, high = torch.aminmax(values)
    return torch.stack([low, high])


class FiniteCheck:
    """Watches the tensors of one update (`watch`); `first_bad` names the first tensor that
    held a NaN or an infinity, None when every one was finite."""

    def __init__(self) -> None:
        self._bad: str | None = None
        self._queued: list[tuple[str, torch.Tensor]] = []

    def watch(self, name: str, values: torch.Tensor) -> None:
        """Check `values` (what arrived for tensor `name`, in its own dtype). Integer tensors
        and empty ones pass; on CUDA the check is queued on the current stream."""
        if self._bad is not None or not values.is_floating_point() or values.numel() == 0:
            return
        found = extremes(values.detach())
        if found.is_cuda:
            self._queued.append((name, found))
        elif not bool(torch.isfinite(found).all()):
            self._bad = name

    def first_bad(self) -> str | None:
        """The first watched tensor holding a non-finite value (one device read for every
        queued check), or None."""
        if self._queued:
            queued, self._queued = self._queued, []
            finite = torch.isfinite(torch.stack([f for _, f in queued])).all(dim=1).tolist()
            bad = [name for (name, _), ok in zip(queued, finite, strict=True) if not ok]
            if bad and self._bad is None:
                self._bad = bad[0]
        return self._bad
