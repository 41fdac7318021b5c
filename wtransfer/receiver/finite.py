"""`FiniteCheck`: the values an update brings, watched for NaN and infinity before it goes live.

One sum per tensor as its bytes land: NaN and infinity make the sum non-finite. On the host a
sum that is not finite is confirmed with the tensor's extremes (a sum can overflow where no
element does); on CUDA the sums (of |x|, every tensor of a bucket in one multi-tensor launch)
are queued behind the copies, and read once at the update's finish (there, an overflowing
sum, of elements near float32's limit, counts as non-finite: its bytes may be gone by then).
FP8 values are checked by their bits.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

_FP8_NON_FINITE: dict[torch.dtype, tuple[int, int]] = {
    dt: mask for name, mask in (("float8_e4m3fn", (0x7F, 0x7F)), ("float8_e5m2", (0x7C, 0x7C)),
                                ("float8_e4m3fnuz", (0xFF, 0x80)),
                                ("float8_e5m2fnuz", (0xFF, 0x80)),
                                ("float8_e8m0fnu", (0xFF, 0xFF)))
    if (dt := getattr(torch, name, None)) is not None}
"""Per FP8 dtype, (mask, pattern): an element is NaN or infinite when its bits & mask equal
the pattern."""


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
        """Device tensors of float32 sums (of |x|), in `_names` order."""

    def watch(self, name: str, values: torch.Tensor) -> None:
        """Check `values` (what arrived for tensor `name`, in its own dtype); integer and
        empty tensors pass. On CUDA the check is queued on the current stream."""
        self.watch_all([(name, values)])

    def watch_all(self, arrived: Sequence[tuple[str, torch.Tensor]]) -> None:
        """`watch` each (name, values), the sums of many tensors in one launch."""
        if self._bad is not None:
            return
        names: list[str] = []
        floats: list[torch.Tensor] = []
        for name, values in arrived:
            if not values.is_floating_point() or values.numel() == 0:
                continue
            values = values.detach()
            if values.dtype in _FP8_NON_FINITE:
                if not all_finite(values):  # (a bit test: exact, on any device)
                    self._bad = name
                    return
                continue
            if values.element_size() == 1:  # a 1-byte float without a bit rule above
                values = values.float()
            names.append(name)
            floats.append(values)
        on_devices: dict[torch.device, list[int]] = {}
        for i, values in enumerate(floats):
            if values.is_cuda:  # queued, read at the finish behind the copies
                on_devices.setdefault(values.device, []).append(i)
            elif not bool(torch.isfinite(values.sum())) and not all_finite(values):
                self._bad = names[i]  # (a sum can overflow where no element does)
                return
        for members in on_devices.values():  # (a bucket on one device, its tensors on another)
            self._names.extend(names[i] for i in members)
            self._sums.append(torch.stack(_sums_of_abs([floats[i] for i in members])))

    def first_bad(self) -> str | None:
        """The first watched tensor holding a non-finite value (one device read for every
        queued sum), or None."""
        if self._names and self._bad is None:
            first = self._sums[0].device
            sums = torch.cat([s.to(first) for s in self._sums])
            bad = (~torch.isfinite(sums)).nonzero().flatten().tolist()
            if bad:
                self._bad = self._names[bad[0]]
        self._names, self._sums = [], []
        return self._bad


def _sums_of_abs(floats: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor's float32 sum of |x|, in order: one multi-tensor launch per dtype (float64
    is summed in its own precision, then narrowed: an overflow reads as non-finite)."""
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, values in enumerate(floats):
        by_dtype.setdefault(values.dtype, []).append(i)
    sums: dict[int, torch.Tensor] = {}
    for dtype, members in by_dtype.items():
        group = [floats[i] for i in members]
        totals = (torch._foreach_norm(group, 1) if dtype == torch.float64
                  else torch._foreach_norm(group, 1, dtype=torch.float32))
        sums.update((i, total.float()) for i, total in zip(members, totals, strict=True))
    return [sums[i] for i in range(len(floats))]
