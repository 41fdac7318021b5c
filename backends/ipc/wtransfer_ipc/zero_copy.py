"""Zero-copy updates over CUDA IPC: the receiver reads the trainer's own tensors.

The sender exports the CUDA storage behind each source tensor once (`export_buffer`), again
only when a tensor's storage changes (detected by pointer), and keeps a reference to every
exported storage so the memory stays valid while receivers map it. One `update_weights` call
carries the whole update: which storages are new, where each tensor lies in them, and a CUDA
IPC event recorded after the trainer's last write. The receiver opens new storages once, makes
its stream wait on the event (no host round trip), copies every tensor straight into its
parameter (one multi-tensor launch), and synchronizes before answering, so `send_weights`
returns only once the receivers finished reading and the optimizer may write again.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import torch

from wtransfer.errors import MetadataError
from wtransfer.packing import TensorMeta
from wtransfer_ipc.cuda import export_buffer, open_buffer


def shareable(tensors: Iterable[torch.Tensor]) -> bool:
    """Whether every tensor can be read in place by another process (contiguous, CUDA)."""
    return all(t.is_cuda and t.is_contiguous() for t in tensors)


def _storage_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class ZeroCopyExports:
    """The sender's exported storages (see the module docstring)."""

    def __init__(self, token: str) -> None:
        self.token = token
        self._exported: list[torch.Tensor | None] = []
        """Byte views of the exported storages (strong references: receivers map them)."""
        self._index: dict[int, int] = {}
        self.event: torch.cuda.Event | None = None
        self._last: tuple[list[int], list[int], list[list[int]]] | None = None
        """The tensors' pointers at the last update, the storages it used, and its layout."""
        self._sent: set[int] = set()
        """Storages whose handle the receivers hold (confirmed by a successful update)."""

    def update(self, tensors: list[torch.Tensor]) -> dict[str, Any]:
        """The zero-copy part of one update of `tensors` (the source's, in manifest order):
        which storages they use (with the handle record of each one the receivers do not
        hold yet), where each tensor lies in them, and the event after the last write."""
        pointers = [t.data_ptr() for t in tensors]
        if self._last is None or self._last[0] != pointers:
            self._last = (pointers, *self._place(tensors))
        _, used, layout = self._last
        storages = [[i, None if i in self._sent else self._record(i)] for i in used]
        device = tensors[0].device if tensors else torch.device("cuda")
        if self.event is None:
            self.event = torch.cuda.Event(interprocess=True)
        self.event.record(torch.cuda.current_stream(device))
        return {"storages": storages, "layout": layout,
                "event": bytes(self.event.ipc_handle()), "token": self.token,
                "sender_pid": os.getpid()}

    def _record(self, index: int) -> list[Any]:
        exported = self._exported[index]
        assert exported is not None  # a storage in use is held
        return export_buffer(exported, self.token, index)

    def confirm(self) -> None:
        """The receivers took the last update: they hold every storage it listed."""
        if self._last is not None:
            self._sent.update(self._last[1])

    def forget(self) -> None:
        """The last update failed: send every storage's handle again next time (a receiver
        that failed may not have opened them)."""
        self._sent.clear()

    def _place(self, tensors: list[torch.Tensor]) -> tuple[list[int], list[list[int]]]:
        """The storages `tensors` use (exporting new ones) and each tensor's [storage, byte
        offset]; worked out again only when a tensor moved. Every exported storage is held,
        so no other storage can appear at a pointer seen before: the same pointers mean the
        same storages and offsets."""
        used: dict[int, None] = {}
        layout = []
        for tensor in tensors:
            if tensor.numel() == 0:  # nothing to read: no storage to share
                layout.append([-1, 0])
                continue
            storage = tensor.untyped_storage()
            index = self._index.get(storage.data_ptr())
            if index is None:
                index = len(self._exported)
                self._exported.append(_storage_bytes(storage))
                self._index[storage.data_ptr()] = index
            used[index] = None
            layout.append([index, int(tensor.storage_offset()) * tensor.element_size()])
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
        self._last: tuple[list[Any], list[TensorMeta], list[torch.Tensor]] | None = None
        """The last layout, its tensor list and the source views it gave (reused while the
        sender's storages and layout stay the same: every step, for a trainer)."""

    def sources(self, update: dict[str, Any], metas: list[TensorMeta],
                device: torch.device) -> list[torch.Tensor]:
        """Each tensor's bytes in the sender's storage, checked against `metas`; the current
        stream waits for the sender's writes."""
        if not isinstance(update, dict) or set(update) != {"storages", "layout", "event",
                                                          "token", "sender_pid"}:
            raise MetadataError("zero_copy must be {storages, layout, event, token, sender_pid}")
        token, pid = update["token"], update["sender_pid"]
        if not isinstance(token, str) or not isinstance(pid, int):
            raise MetadataError("zero_copy token must be a string and sender_pid an int")
        if token != self._token:  # a new sender: nothing opened before is its
            self._opened, self._token, self._last = {}, token, None
        listed = update["storages"]
        if not isinstance(listed, list) or len(listed) > 1 << 20:
            raise MetadataError("zero_copy storages must be a list")
        keep: dict[int, torch.Tensor] = {}
        for item in listed:
            if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], int)):
                raise MetadataError("zero_copy storages holds [index, record or null] pairs")
            index, record = item
            if record is not None:
                keep[index] = open_buffer(record, token=token, index=index,
                                          same_process=pid == os.getpid(), size=0)
            elif index in self._opened:
                keep[index] = self._opened[index]
            else:
                raise MetadataError(f"zero_copy storage {index} was never sent")
        self._opened = keep
        layout = update["layout"]
        unchanged = all(record is None for _, record in listed)
        if unchanged and self._last is not None and self._last[1] is metas and \
                self._last[0] == layout:
            out = self._last[2]
            self._wait(update, pid, device)
            return out
        if not isinstance(layout, list) or len(layout) != len(metas):
            raise MetadataError(f"zero_copy layout must list one [storage, offset] per "
                                f"announced tensor ({len(metas)})")
        out = []
        empty = torch.empty(0, dtype=torch.uint8, device=device)
        for meta, place in zip(metas, layout, strict=True):
            if meta.nbytes == 0 and place == [-1, 0]:
                out.append(empty)
                continue
            if not (isinstance(place, list) and len(place) == 2
                    and all(isinstance(v, int) and v >= 0 for v in place)):
                raise MetadataError(f"zero_copy layout of {meta.name!r} must be [storage, offset]")
            storage = keep.get(place[0])
            if storage is None:
                raise MetadataError(f"zero_copy layout of {meta.name!r} names storage "
                                    f"{place[0]}, which the update does not list")
            if place[1] % meta.itemsize or place[1] + meta.nbytes > storage.numel():
                raise MetadataError(f"zero_copy: {meta.name!r} at byte {place[1]} "
                                    f"({meta.nbytes} bytes) does not fit its {storage.numel()}-"
                                    "byte storage aligned")
            out.append(storage[place[1] : place[1] + meta.nbytes])
        self._last = (layout, metas, out)
        self._wait(update, pid, device)
        return out

    @staticmethod
    def _wait(update: dict[str, Any], pid: int, device: torch.device) -> None:
        """The current stream waits for the sender's writes (its IPC event)."""
        event = update["event"]
        if not isinstance(event, bytes):
            raise MetadataError("zero_copy event must be bytes")
        if pid != os.getpid():
            torch.cuda.current_stream(device).wait_event(
                torch.cuda.Event.from_ipc_handle(device, event))

    def close(self) -> None:
        """Drop every mapping."""
        self._opened = {}
        self._last = None
