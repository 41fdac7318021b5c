"""`FiniteCheck`: the values an update brings, watched for NaN and infinity before it goes live.

One sum per tensor as its bytes land: NaN and infinity make the sum non-finite, and a sum is
the cheapest full read a device offers (on 2 host cores, 1.7x faster than a min/max). On the
host a sum that is not finite is confirmed with the tensor's extremes (a sum can overflow
where no element does); on CUDA the sums are written into one device buffer, queued behind the
copies, and read once at the update's finish (there, an overflowing sum, of elements near
float32's limit, counts as non-finite: its bytes may be gone by then). FP8 values are checked
by their bits.
"""

from __future__ import annotations

import torch

_FP8_NON_FINITE: dict[torch.dtype, tuple[int, int]] = {
    dt: mask for name, mask in (("float8_e4m3fn", (0x7F, 0x7F)), ("float8_e5m2", (0x7C, 0x7C)),
                                ("float8_e4m3fnuz", (0xFF, 0x80)),
                                ("float8_e5m2fnuz", (0xFF, 0x80)),
                                ("float8_e8m0fnu", (0xFF, 0xFF)))
    if (dt := getattr(torch, name, None)) is not None}
"""Per FP8 dtype, (mask, pattern): an element is NaN or infinite when its bits & mask equal
the pattern."""
_SLOTS = 1024
"""Sums one device buffer holds (a new buffer is added when it is full)."""


def all_finite(values: torch.Tensor) -> bool:
    """Whether every element of floating-point `values` is finite (exact; reads them)."""
    mask = _FP8_NON_FINITE.get(values.dtype)
    if mask is not None:
        bits = values.view(torch.uint8)
        return not bool(((bits & mask[0]) == mask[1]).any())
    low, high = torch.aminmax(values)
    return bool(torch.isfinite(low) & torch.isfinite(high))


class FiniteCheck:
    """Watches the tensors of one update (`watch`); `first_bad` names the first tensor that
    held a NaN or an infinity, None when every one was finite."""

    def __init__(self) -> None:
        self._bad: str | None = None
        self._names: list[str] = []
        self._sums: list[torch.Tensor] = []
        """Device buffers of `_SLOTS` float32 sums, filled in `_names` order."""

    def watch(self, name: str, values: torch.Tensor) -> None:
        """Check `values` (what arrived for tensor `name`, in its own dtype); integer and
        empty tensors pass. On CUDA the check is queued on the current stream."""
        if self._bad is not None or not values.is_floating_point() or values.numel() == 0:
            return
        values = values.detach()
        if values.dtype in _FP8_NON_FINITE:
            if not all_finite(values):  # (a bit test: exact, on any device)
                self._bad = name
            return
        if values.element_size() == 1:  # a 1-byte float without a bit rule above
            values = values.float()
        if not values.is_cuda:
            if not bool(torch.isfinite(values.sum())) and not all_finite(values):
                self._bad = name
            return
        slot = len(self._names) % _SLOTS
        if slot == 0:
            self._sums.append(torch.empty(_SLOTS, dtype=torch.float32, device=values.device))
        torch.sum(values.reshape(-1), dim=0, dtype=torch.float32, out=self._sums[-1][slot])
        self._names.append(name)

    def first_bad(self) -> str | None:
        """The first watched tensor holding a non-finite value (one device read for every
        queued sum), or None."""
        if self._names and self._bad is None:
            sums = torch.cat(self._sums)[: len(self._names)]
            bad = (~torch.isfinite(sums)).nonzero().flatten().tolist()
            if bad:
                self._bad = self._names[bad[0]]
        self._names, self._sums = [], []
        return self._bad
