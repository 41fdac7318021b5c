"""Zero-copy updates over CUDA IPC: the receiver reads the trainer's own tensors.

The sender exports the CUDA storage behind each source tensor once (`export_buffer`), again
only when a tensor's storage changes (detected by pointer), and keeps a reference to every
exported storage so the memory stays valid while receivers map it. One `update_weights` call
carries the whole update: which storages are new, where each tensor lies in them, and a CUDA
IPC event recorded after the trainer's last write. The receiver opens new storages once, makes
its stream wait on the event (no host round trip), copies every tensor straight into its
parameter (issued a few tensors at a time while it places the rest), and waits for the copies
(within the transfer's deadline) before answering, so `send_weights` returns only once the
receivers finished reading and the optimizer may write again.

Wire form: the update info's ``zero_copy`` field, a `wtransfer_ipc.info.ZeroCopyUpdate`.
"""

from __future__ import annotations

import os
from array import array
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from wtransfer.errors import MetadataError
from wtransfer.packing import TensorMeta
from wtransfer.wire import record_to_wire
from wtransfer_ipc.cuda import (
    SenderEvents,
    export_buffer,
    exported_event,
    open_buffer,
    withdraw_event,
)
from wtransfer_ipc.info import ZeroCopyUpdate


@dataclass(frozen=True)
class _Placement:
    """Where the source's tensors lay at the last update, and that update's fields."""

    pointers: list[int]
    used: list[int]
    used_bytes: bytes
    layout_bytes: bytes


@dataclass(frozen=True)
class _Sources:
    """What the last update's `used`, `layout` and tensor list resolved to (reused while all
    three stay the same: every step, for a trainer)."""

    used: bytes
    layout: bytes
    metas: list[TensorMeta]
    views: list[torch.Tensor]


def shareable(tensors: Iterable[torch.Tensor]) -> bool:
    """Whether every tensor can be read in place by another process (contiguous, CUDA)."""
    return all(t.is_cuda and t.is_contiguous() for t in tensors)


def _packed(values: list[int]) -> bytes:
    return array("q", values).tobytes()


def _unpacked(data: bytes) -> list[int]:
    return array("q", data).tolist()


def _storage_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class ZeroCopyExports:
    """The sender's exported storages (see the module docstring)."""

    def __init__(self, token: str) -> None:
        self.token = token
        self._exported: list[torch.Tensor | None] = []
        """Byte views of the exported storages (strong references: receivers map them)."""
        self._index: dict[int, int] = {}
        self.event: tuple[torch.cuda.Event, bytes] | None = None
        """The event recorded after the trainer's last write, and its IPC handle."""
        self._last: _Placement | None = None
        self._sent: set[int] = set()
        """Storages whose handle the receivers hold (confirmed by a successful update)."""

    def update(self, tensors: list[torch.Tensor]) -> dict[str, Any]:
        """The zero-copy part of one update of `tensors` (the source's, in manifest order):
        which storages they use (with the handle record of each one the receivers do not
        hold yet), where each tensor lies in them, and the event after the last write."""
        pointers = [t.data_ptr() for t in tensors]
        last = self._last
        if last is None or last.pointers != pointers:
            used, layout = self._place(tensors)
            last = self._last = _Placement(pointers, used, _packed(used), _packed(layout))
        device = next((t.device for t in tensors if t.numel()), torch.device("cuda"))
        if self.event is None:
            self.event = exported_event(device)
        self.event[0].record(torch.cuda.current_stream(device))
        sent = self._sent
        return record_to_wire(ZeroCopyUpdate(
            storages=[] if sent.issuperset(last.used) else
            [(i, self._record(i)) for i in last.used if i not in sent],
            used=last.used_bytes, layout=last.layout_bytes, event=self.event[1],
            token=self.token, sender_pid=os.getpid()))

    def _record(self, index: int) -> list[Any]:
        exported = self._exported[index]
        assert exported is not None  # a storage in use is held
        return export_buffer(exported, self.token, index)

    def confirm(self) -> None:
        """The receivers took the last update: they hold every storage it listed."""
        if self._last is not None:
            self._sent.update(self._last.used)

    def forget(self) -> None:
        """The last update failed: send every storage's handle again next time (a receiver
        that failed may not have opened them)."""
        self._sent.clear()

    def close(self) -> None:
        """Drop every exported storage and the event."""
        if self.event is not None:
            withdraw_event(self.event[1])
        self.event = None
        self._exported, self._index, self._last = [], {}, None
        self._sent.clear()

    def _place(self, tensors: list[torch.Tensor]) -> tuple[list[int], list[int]]:
        """The storages `tensors` use (exporting new ones) and each tensor's storage and byte
        offset, flat; worked out again only when a tensor moved. Every exported storage is
        held, so no other storage can appear at a pointer seen before: the same pointers mean
        the same storages and offsets."""
        used: dict[int, None] = {}
        layout: list[int] = []
        for tensor in tensors:
            if tensor.numel() == 0:  # nothing to read: no storage to share
                layout += (-1, 0)
                continue
            storage = tensor.untyped_storage()
            index = self._index.get(storage.data_ptr())
            if index is None:
                index = len(self._exported)
                self._exported.append(_storage_bytes(storage))
                self._index[storage.data_ptr()] = index
            used[index] = None
            layout += (index, int(tensor.storage_offset()) * tensor.element_size())
        for key, index in list(self._index.items()):  # storages the source no longer uses
            if index not in used:
                del self._index[key]
                self._exported[index] = None
                self._sent.discard(index)
        return sorted(used), layout


class ZeroCopyImports:
    """The receiver's opened storages, by the sender's index (see the module docstring)."""

    def __init__(self) -> None:
        self._opened: dict[int, torch.Tensor] = {}
        self._token: str | None = None
        self._last: _Sources | None = None
        self._events = SenderEvents()

    def sources(self, update: ZeroCopyUpdate, metas: list[TensorMeta],
                device: torch.device) -> list[torch.Tensor]:
        """Each tensor's bytes in the sender's storage, checked against `metas`; the current
        stream waits for the sender's writes."""
        last = self._last if self._current(update) else None
        if last is None or last.layout != update.layout or last.metas is not metas:
            last = self._last = _Sources(update.used, update.layout, metas, self._place(
                _unpacked(update.layout), metas, device))
        self._events.wait(update.event, device)
        return last.views

    def opened(self, update: ZeroCopyUpdate, device: torch.device
               ) -> tuple[dict[int, torch.Tensor], list[int]]:
        """The storages `update` reads (uint8, by the sender's index) and its layout (each
        tensor's storage index and byte offset, flat); the current stream waits for the
        sender's writes."""
        self._current(update)
        self._events.wait(update.event, device)
        return self._opened, _unpacked(update.layout)

    def _current(self, update: ZeroCopyUpdate) -> bool:
        """Open what `update` sends and keep what it uses; whether the storages are the last
        update's (its placed views still hold)."""
        if update.token != self._token:  # a new sender: nothing opened before is its
            self._opened, self._token, self._last = {}, update.token, None
            self._events.close()
        last = self._last
        if update.storages or last is None or last.used != update.used:
            self._open(update.storages, _unpacked(update.used), update.token,
                       update.sender_pid == os.getpid())
            self._last = None
            return False
        return True

    def _open(self, new: list[tuple[int, list[Any]]], used: list[int], token: str,
              same_process: bool) -> None:
        """Open the storages sent with handles; keep exactly those the update uses (in a new
        mapping whenever that changes: an unchanged one is the very same object, which tells
        a reader its views of it still hold)."""
        opened = dict(self._opened) if new else self._opened
        for index, record in new:
            opened[index] = open_buffer(record, token=token, index=index,
                                        same_process=same_process, size=0)
        missing = [i for i in used if i not in opened]
        if missing:
            raise MetadataError(f"zero_copy storage {missing[0]} was never sent")
        if new or opened.keys() != set(used):
            self._opened = {i: opened[i] for i in used}

    def _place(self, layout: list[int], metas: list[TensorMeta],
               device: torch.device) -> list[torch.Tensor]:
        """Each tensor's bytes in its storage, checked against `metas`."""
        if len(layout) != 2 * len(metas):
            raise MetadataError(f"zero_copy layout must hold a storage and an offset for each "
                                f"of the {len(metas)} announced tensors")
        out = []
        empty = torch.empty(0, dtype=torch.uint8, device=device)
        for i, meta in enumerate(metas):
            index, offset = layout[2 * i], layout[2 * i + 1]
            if meta.nbytes == 0 and index == -1:
                out.append(empty)
                continue
            storage = self._opened.get(index)
            if storage is None:
                raise MetadataError(f"zero_copy layout of {meta.name!r} names storage "
                                    f"{index}, which the update does not list")
            if offset < 0 or offset % meta.itemsize or offset + meta.nbytes > storage.numel():
                raise MetadataError(f"zero_copy: {meta.name!r} at byte {offset} "
                                    f"({meta.nbytes} bytes) does not fit its {storage.numel()}-"
                                    "byte storage aligned")
            out.append(storage[offset : offset + meta.nbytes])
        return out

    def close(self) -> None:
        """Drop every mapping."""
        self._opened = {}
        self._last = None
        self._events.close()
