"""The IPC backend's init and update records (what travels on the control plane)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from wtransfer.errors import ConfigError
from wtransfer.infos import ReceiverInitInfo, TrainerInitInfo, UpdateInfo

TRANSPORTS = ("shm", "cuda")


@dataclass(frozen=True, kw_only=True)
class IPCTrainerInitInfo(TrainerInitInfo):
    """Trainer-side options of the IPC backend (wire parameters come from the base class)."""

    backend: ClassVar[str] = "ipc"
    device: str | None = None
    """Where staging buffers live ("cpu" -> shared memory, "cuda:N" -> CUDA IPC); default: the
    device of the source's tensors."""


@dataclass(frozen=True, kw_only=True)
class IPCInitInfo(ReceiverInitInfo):
    """What the sender tells each receiver once: the staging buffers to open."""

    transport: str
    """"shm" (POSIX shared memory segment names) or "cuda" (CUDA IPC handle records)."""
    buffers: list[Any]
    """One entry per staging buffer: a segment name, or a CUDA handle record."""
    sender_pid: int
    token: str
    """Identifies this sender's buffers (same-process receivers use them directly)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.transport not in TRANSPORTS:
            raise ConfigError(f"transport must be one of {TRANSPORTS}, got {self.transport!r}")
        if len(self.buffers) != self.num_buffers:
            raise ConfigError(f"buffers lists {len(self.buffers)} entries for "
                              f"num_buffers={self.num_buffers}")


@dataclass(frozen=True, kw_only=True)
class IPCUpdateInfo(UpdateInfo):
    """One bucket, ready in staging buffer `buffer` (the first also announces the tensors)."""

    tensors: list[Any] | None = None
    """``[[name, dtype, shape], ...]`` of the whole update; sent with the first bucket."""
    buffer: int = 0
    nbytes: int = 0
    slices: list[Any] = field(default_factory=list)
    """``[[tensor_index, tensor_offset, offset, nbytes], ...]`` placed in this bucket."""
    checksum: int | None = None
