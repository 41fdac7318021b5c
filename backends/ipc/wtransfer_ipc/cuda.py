"""CUDA IPC staging buffers, through torch's own storage-sharing internals.

The sender exports each staging buffer once with ``UntypedStorage._share_cuda_()``: the
runtime's raw ``cudaIpcMemHandle_t`` plus allocator bookkeeping (size, offset, a shared
reference counter and an IPC event handle), all plain bytes and ints, so they travel through
`wtransfer.wire`. A receiver in another process opens them once with
``UntypedStorage._new_shared_cuda(...)`` and reuses the mapping across updates. A receiver in
the sender's own process cannot open its own IPC handle, so it uses the buffer directly.
"""

from __future__ import annotations

import os
import time
import weakref
from typing import Any

import torch

from wtransfer.errors import ConfigError, MetadataError, TransferTimeout
from wtransfer.protocol import spinning

_local: weakref.WeakValueDictionary[str, torch.Tensor] = weakref.WeakValueDictionary()


def export_buffer(buffer: torch.Tensor, token: str, index: int) -> list[Any]:
    """Plain-data handle record of a CUDA staging buffer; registers it for same-process use."""
    _local[f"{token}/{index}"] = buffer
    (device, handle, size, offset, ref_handle, ref_offset, event_handle,
     event_sync) = buffer.untyped_storage()._share_cuda_()
    return [int(device), bytes(handle), int(size), int(offset), bytes(ref_handle),
            int(ref_offset), bytes(event_handle) if event_handle else b"", bool(event_sync)]


def open_buffer(record: Any, *, token: str, index: int, same_process: bool,
                size: int) -> torch.Tensor:
    """Map a sender's staging buffer into this process as a flat uint8 CUDA tensor."""
    if same_process:
        local = _local.get(f"{token}/{index}")
        if local is None:
            raise MetadataError(f"no CUDA staging buffer {token}/{index} in this process")
        return local
    if not (isinstance(record, list) and len(record) == 8
            and isinstance(record[0], int) and isinstance(record[1], bytes)
            and isinstance(record[2], int) and isinstance(record[3], int)
            and isinstance(record[4], bytes) and isinstance(record[5], int)
            and isinstance(record[6], bytes) and isinstance(record[7], bool)):
        raise MetadataError("CUDA handle record must be [device, handle, size, offset, "
                            "ref_handle, ref_offset, event_handle, event_sync]")
    device = record[0]
    if not torch.cuda.is_available() or not 0 <= device < torch.cuda.device_count():
        raise ConfigError(f"CUDA IPC handle is for device {device}, which this process "
                          "cannot see (check CUDA_VISIBLE_DEVICES on both sides)")
    if record[2] < size:
        raise MetadataError(f"CUDA staging buffer of {record[2]} bytes is smaller than the "
                            f"{size}-byte bucket")
    torch.cuda._lazy_init()
    args = list(record)
    args[6] = args[6] or None
    storage = torch.UntypedStorage._new_shared_cuda(*args)
    tensor = torch.empty(0, dtype=torch.uint8, device=f"cuda:{device}")
    tensor.set_(storage, 0, (record[2],), (1,))
    return tensor


_local_events: dict[bytes, torch.cuda.Event] = {}
"""Exported events by handle, for receivers in the sender's own process (held strongly until
`withdraw_event`: torch's events do not take weak references safely)."""


def exported_event(device: torch.device) -> tuple[torch.cuda.Event, bytes]:
    """A new interprocess event on `device` (the sender records it after each write a
    receiver must wait for) and its IPC handle; registered for receivers in the sender's own
    process until `withdraw_event`."""
    with torch.cuda.device(device):  # the event is created on the current device
        event = torch.cuda.Event(interprocess=True)
        handle = bytes(event.ipc_handle())
    _local_events[handle] = event
    return event, handle


def withdraw_event(handle: bytes) -> None:
    """Forget an event `exported_event` registered (its sender is closing)."""
    _local_events.pop(handle, None)


class SenderEvents:
    """The sender's events a receiver uses, each handle opened once (a sender's events are
    recorded again every update): it waits on the trainer's records, and records the events
    the trainer waits on."""

    _MAX_OPEN = 256

    def __init__(self) -> None:
        self._opened: dict[bytes, torch.cuda.Event] = {}

    def wait(self, handle: object, device: torch.device) -> None:
        """Make `device`'s current stream wait for the sender's last record of `handle`'s
        event (no host round trip)."""
        torch.cuda.current_stream(device).wait_event(self._open(handle, device))

    def record(self, handle: object, device: torch.device) -> None:
        """Record `handle`'s event on `device`'s current stream: the sender's stream, waiting
        on it, runs on once everything queued here before it ran."""
        self._open(handle, device).record(torch.cuda.current_stream(device))

    def _open(self, handle: object, device: torch.device) -> torch.cuda.Event:
        if not isinstance(handle, bytes):
            raise MetadataError("event must be bytes (a CUDA IPC event handle)")
        event = self._opened.get(handle)
        if event is None:
            event = _local_events.get(handle)  # a sender in this process
        if event is None:
            if len(self._opened) >= self._MAX_OPEN:  # a sender that never reuses its events
                self._opened.clear()
            try:
                event = torch.cuda.Event.from_ipc_handle(device, handle)
            except RuntimeError as exc:
                raise MetadataError(f"cannot open the sender's CUDA IPC event: {exc}") from None
            self._opened[handle] = event
        return event

    def close(self) -> None:
        """Drop every opened event."""
        self._opened = {}


_POLL_S = 0.00005


def drain(device: torch.device, timeout_s: float, spin_from: float | None = None) -> None:
    """Return once everything queued on `device`'s current stream ran, or raise
    `TransferTimeout` after `timeout_s`: its copies may wait on a trainer's event, and a
    trainer that died before its writes ran must not hold the engine's call forever (a plain
    stream synchronize has no deadline). From `spin_from` (monotonic seconds) on, it polls
    without sleeping (see `await_event`)."""
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(device))
    await_event(done, timeout_s, "copies out of the trainer's memory",
                "is the trainer process alive?", spin_from)


def await_event(event: torch.cuda.Event, timeout_s: float, what: str, hint: str,
                spin_from: float | None = None) -> None:
    """Poll `event` (its last record, possibly another process's) until it completed, or
    raise `TransferTimeout` naming `what` after `timeout_s`. Between polls it sleeps
    `_POLL_S` (which a host may stretch to a few hundred microseconds: timer slack, a core
    waking from idle), but only yields the processor from `spin_from` (monotonic seconds;
    None: never) on, for `protocol.SPIN_WINDOW_S`: a caller that expects the event soon learns
    of it at once."""
    deadline = time.monotonic() + timeout_s
    while not event.query():
        now = time.monotonic()
        if now > deadline:
            raise TransferTimeout(f"{what} did not complete within {timeout_s:g}s: {hint}")
        if spinning(spin_from, now):
            os.sched_yield()  # (a sleep of zero would still wait out the timer slack)
        else:
            time.sleep(_POLL_S)
