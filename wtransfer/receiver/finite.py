"""`FiniteCheck`: the values an update brings, watched for NaN and infinity before it goes live.

One sum per tensor as its bytes land: NaN and infinity make the sum non-finite. On the host a
sum that is not finite is confirmed with the tensor's extremes (a sum can overflow where no
element does); on CUDA the sums (of |x|, every tensor of a bucket in one multi-tensor launch)
are queued behind the copies, and read once at the update's finish (there, an overflowing
sum, of elements near float32's limit, counts as non-finite: its bytes may be gone by then).
FP8 values are checked by their bits. Where Triton is, a large CUDA tensor copied whole is
checked by its copy (`copies`: `wtransfer.receiver.finite_copy`), which reads it only once and
tests each value's exponent bits (exact: huge finite values pass there).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from types import ModuleType

import torch

log = logging.getLogger("wtransfer.receiver.finite")

CHECKED_COPY_MIN_BYTES = 1 << 20
"""Copies from this size check as they copy (`FiniteCheck.copies`); smaller ones batch their
copies and their sums better."""

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
        self._copies: list[CheckedCopies] = []
        """Checked copies (their names and int32 flags: 1, the copy saw a non-finite value)."""

    def copies(self, device: torch.device, capacity: int) -> CheckedCopies | None:
        """Up to `capacity` copies onto CUDA `device` that check what they copy, or None where
        none can (no CUDA, no Triton, or a value already failed)."""
        if self._bad is not None or device.type != "cuda" or checked_copy_kernel() is None:
            return None
        copies = CheckedCopies(device, capacity)
        self._copies.append(copies)
        return copies

    def flagged(self, names: list[str], flags: torch.Tensor) -> None:
        """Take the flags of copies that checked as they copied outside `copies` (a replayed
        copy graph): `flags[i]` (int32, 1: non-finite) belongs to `names[i]`."""
        if self._bad is None and names:
            self._copies.append(CheckedCopies(flags.device, len(names), names, flags))

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
        """A watched tensor holding a non-finite value (the first such of the sums, else of
        the checked copies; one device read for all the sums, one for all the flags), or
        None."""
        if self._names and self._bad is None:
            first = self._sums[0].device
            sums = torch.cat([s.to(first) for s in self._sums])
            bad = (~torch.isfinite(sums)).nonzero().flatten().tolist()
            if bad:
                self._bad = self._names[bad[0]]
        used = [c for c in self._copies if c.names]
        if used and self._bad is None:
            first = used[0].flags.device
            flags = torch.cat([c.flags[:len(c.names)].to(first) for c in used])
            bad = flags.nonzero().flatten().tolist()
            if bad:
                self._bad = [n for c in used for n in c.names][bad[0]]
        self._names, self._sums, self._copies = [], [], []
        return self._bad


class CheckedCopies:
    """Copies of one update's tensors onto one CUDA device that check what they copy
    (`FiniteCheck.copies`); `FiniteCheck.first_bad` reads their flags."""

    def __init__(self, device: torch.device, capacity: int, names: list[str] | None = None,
                 flags: torch.Tensor | None = None) -> None:
        self._device = device
        self._capacity = capacity
        self.names: list[str] = names if names is not None else []
        """The tensors copied so far, in the order of their flags."""
        self._flags: torch.Tensor | None = flags
        """One int32 per copy (made at the first copy: none for a bucket without one)."""

    @property
    def flags(self) -> torch.Tensor:
        """One int32 per copy (1: it saw a non-finite value), on the device."""
        if self._flags is None:
            self._flags = torch.zeros(max(self._capacity, 1), dtype=torch.int32,
                                      device=self._device)
        return self._flags

    def add(self, name: str, dst: torch.Tensor, src: torch.Tensor, dtype: torch.dtype) -> bool:
        """Copy flat uint8 `src` into `dst`, the values of tensor `name` in `dtype`, checking
        them as they are copied (queued on this device's current stream); False where this
        copy cannot check (another device, a small copy, a dtype or an alignment it has no
        rule for, or the kernel failed): then the caller copies and checks as before."""
        if len(self.names) >= self._capacity \
                or not checks_in_copy(dst, src, dtype, self._device):
            return False
        kernel = checked_copy_kernel()
        assert kernel is not None  # (checks_in_copy found it)
        try:
            kernel.copy_and_flag(dst, src, dtype, self.flags, len(self.names))
        except Exception as exc:  # (a device or a Triton it cannot compile for)
            _disable_checked_copy(exc)
            return False
        self.names.append(name)
        return True


def checks_in_copy(dst: torch.Tensor, src: torch.Tensor, dtype: torch.dtype,
                   device: torch.device) -> bool:
    """Whether the checked copy takes this copy of flat uint8 `src` into `dst` (values of
    `dtype`) on CUDA `device`: Triton is there, the copy is large, the dtype has an exponent
    rule, both sides lie on `device`, aligned to the values."""
    kernel = checked_copy_kernel()
    nbytes = dst.numel()
    size = dtype.itemsize
    return (kernel is not None and nbytes >= CHECKED_COPY_MIN_BYTES
            and dtype in kernel.EXPONENT and dst.device == device and src.device == device
            and src.numel() == nbytes and not nbytes % size and not dst.data_ptr() % size
            and not src.data_ptr() % size)


_KERNEL: list[ModuleType | None] = []
"""The checked copy's module once looked for (None in it: not here)."""


def checked_copy_kernel() -> ModuleType | None:
    """`wtransfer.receiver.finite_copy` where Triton imports (and has not failed), else
    None."""
    if not _KERNEL:
        try:
            from wtransfer.receiver import finite_copy
        except ImportError:
            _KERNEL.append(None)
        except Exception as exc:  # (a Triton that is there but broken)
            _KERNEL.append(None)
            log.warning("the checked copy is off: importing it failed (%s: %s)",
                        type(exc).__name__, exc)
        else:
            _KERNEL.append(finite_copy)
    return _KERNEL[0]


def _disable_checked_copy(exc: BaseException) -> None:
    """The kernel failed on this machine: copies check the batched way from now on."""
    log.warning("the checked copy failed (%s: %s); copies are checked after they land",
                type(exc).__name__, exc)
    _KERNEL[:] = [None]


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
