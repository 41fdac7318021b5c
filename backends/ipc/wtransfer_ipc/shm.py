"""POSIX shared-memory staging buffers (Linux: files under /dev/shm).

The sender creates and fully reserves each segment up front (`posix_fallocate`), so a full
/dev/shm is a clear `ConfigError` at init rather than a SIGBUS in the middle of a transfer.
Once every receiver has mapped the segments, the sender unlinks their names: the memory lives
exactly as long as some process maps it.

A receiver on a CUDA device page-locks its mapping of each segment (`SharedBuffer.pin`,
cudaHostRegister), so its copies out of staging run at the host link's speed instead of
through the driver's bounce buffers (a pageable copy: about a tenth of it on an H200 host).

A process can die between creating a segment and unlinking its name (a trainer killed while
its receivers map them). So nothing is left behind: a segment's name carries its creator
(``wtransfer_<pid>_<start time>_<token>_<n>``: the pid, and the process's start time so a
reused pid does not pass for the creator); a receiver unlinks a name it mapped whose creator
is gone; and every sender and receiver sweeps, when it starts, the names whose creators are
gone (`sweep`).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import secrets

import torch

from wtransfer.errors import ConfigError, MetadataError
from wtransfer_ipc.sender_process import start_time

SHM_DIR = "/dev/shm"
_NAME = re.compile(r"^wtransfer_(?P<pid>[0-9]{1,10})_(?P<start>[0-9]{1,20})"
                   r"_[0-9a-f]{16}_[0-9]{1,2}$")


def creator_alive(name: str) -> bool:
    """Whether the process that created segment `name` is still running."""
    match = _NAME.match(name)
    if match is None:
        return False
    return start_time(int(match["pid"])) == int(match["start"])


def sweep() -> list[str]:
    """Unlink every wtransfer segment whose creator is gone; returns the names removed."""
    removed: list[str] = []
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return removed
    for name in names:
        if _NAME.match(name) and not creator_alive(name):
            with contextlib.suppress(FileNotFoundError, PermissionError):
                os.unlink(os.path.join(SHM_DIR, name))
                removed.append(name)
    return removed


class SharedBuffer:
    """One mapped shared-memory segment, exposed as a flat uint8 tensor."""

    def __init__(self, name: str, size: int, *, create: bool) -> None:
        if not _NAME.match(name):
            raise MetadataError(f"refusing shared-memory name {name!r:.80}: not a wtransfer "
                                "segment name")
        self.name = name
        self.path = os.path.join(SHM_DIR, name)
        self.size = size
        self._unlinked = not create
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        try:
            fd = os.open(self.path, flags, 0o600)
        except FileNotFoundError:
            raise MetadataError(f"shared-memory segment {name!r} does not exist (the sender "
                                "is gone, or is on another host: ipc needs one host)") from None
        except OSError as exc:
            raise ConfigError(f"cannot open shared memory {self.path}: {exc}") from None
        try:
            if create:
                try:
                    os.posix_fallocate(fd, 0, size)
                except OSError as exc:
                    os.unlink(self.path)
                    free = os.statvfs(SHM_DIR)
                    raise ConfigError(
                        f"cannot reserve {size} bytes in {SHM_DIR} ({exc.strerror}; "
                        f"{free.f_bavail * free.f_frsize} bytes free): lower bucket_bytes or "
                        f"num_buffers, or enlarge {SHM_DIR}") from None
            elif os.fstat(fd).st_size < size:
                raise MetadataError(f"shared-memory segment {name!r} holds "
                                    f"{os.fstat(fd).st_size} bytes, fewer than {size}")
            populate = getattr(mmap, "MAP_POPULATE", 0)
            self._map: mmap.mmap | None = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | populate)
        finally:
            os.close(fd)
        self.tensor: torch.Tensor | None = torch.frombuffer(self._map, dtype=torch.uint8)
        self._pinned = False

    def pin(self) -> bool:
        """Page-lock this mapping for CUDA copies (cudaHostRegister); False (and unpinned)
        when the driver refuses, e.g. over the locked-memory limit: copies still work, slower."""
        if self._pinned or self.tensor is None or not torch.cuda.is_available():
            return self._pinned
        status = torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), self.size, 0)
        self._pinned = int(status) == 0
        return self._pinned

    def _unpin(self) -> None:
        if self._pinned and self.tensor is not None:
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
        self._pinned = False

    @classmethod
    def create_set(cls, count: int, size: int) -> list[SharedBuffer]:
        """Create `count` fresh segments of `size` bytes, named after this process (after
        sweeping what dead creators left)."""
        sweep()
        pid = os.getpid()
        prefix = f"wtransfer_{pid}_{start_time(pid) or 0}_{secrets.token_hex(8)}"
        made: list[SharedBuffer] = []
        try:
            for i in range(count):
                made.append(cls(f"{prefix}_{i}", size, create=True))
        except BaseException:
            for buf in made:
                buf.close()
            raise
        return made

    def unlink(self) -> None:
        """Remove the name, if this side created it and has not yet; the memory stays valid
        while any process maps it."""
        if not self._unlinked:
            self.remove_name()

    def remove_name(self) -> None:
        """Remove the name whoever created it (a receiver does, when the creator is gone)."""
        self._unlinked = True
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def close(self) -> None:
        """Unmap (and unlink, if this side created it and has not yet)."""
        self.unlink()
        self._unpin()
        self.tensor = None
        if self._map is not None:
            with contextlib.suppress(BufferError):  # a view still alive: the GC unmaps it later
                self._map.close()
            self._map = None
