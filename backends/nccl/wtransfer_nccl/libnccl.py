"""A ctypes binding to the NCCL library itself (``libnccl.so.2``), found at run time.

Only what the backend uses: unique id, communicator init/abort/destroy, broadcast,
point-to-point send and receive (M->N transfers), group start/end, async error query.
Search order: ``$WTRANSFER_NCCL_LIBRARY``, the ``nvidia-nccl-cu12``/``-cu13`` wheels, the copy
next to torch, then the system loader path.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import importlib.util
import os
from functools import cache
from pathlib import Path

from wtransfer.errors import ConfigError, PeerError

NCCL_UINT8 = 1
NCCL_SUCCESS = 0
NCCL_IN_PROGRESS = 7


class UniqueId(ctypes.Structure):
    """``ncclUniqueId``: 128 opaque bytes, passed by value."""

    _fields_ = [("internal", ctypes.c_byte * 128)]


def _candidates() -> list[str]:
    found: list[str] = []
    env = os.environ.get("WTRANSFER_NCCL_LIBRARY")
    if env:
        found.append(env)
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        found += sorted(glob.glob(os.path.join(root, "**", "libnccl.so*"), recursive=True))
    torch_spec = importlib.util.find_spec("torch")
    if torch_spec and torch_spec.origin:
        found += sorted(glob.glob(str(Path(torch_spec.origin).parent / "lib" / "libnccl.so*")))
    system = ctypes.util.find_library("nccl")
    if system:
        found.append(system)
    return found


class NCCLLibrary:
    """The loaded library with typed entry points; raises `PeerError` on NCCL failures."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lib = ctypes.CDLL(path)
        lib = self._lib
        lib.ncclGetErrorString.restype = ctypes.c_char_p
        lib.ncclGetErrorString.argtypes = [ctypes.c_int]
        lib.ncclGetVersion.argtypes = [ctypes.POINTER(ctypes.c_int)]
        lib.ncclGetUniqueId.argtypes = [ctypes.POINTER(UniqueId)]
        lib.ncclCommInitRank.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int,
                                         UniqueId, ctypes.c_int]
        lib.ncclBroadcast.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                                      ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                                      ctypes.c_void_p]
        for name in ("ncclSend", "ncclRecv"):
            getattr(lib, name).argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                           ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
        lib.ncclCommGetAsyncError.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]
        lib.ncclGroupStart.argtypes = []
        lib.ncclGroupEnd.argtypes = []
        lib.ncclCommAbort.argtypes = [ctypes.c_void_p]
        lib.ncclCommDestroy.argtypes = [ctypes.c_void_p]

    def _check(self, result: int, what: str) -> None:
        if result not in (NCCL_SUCCESS, NCCL_IN_PROGRESS):
            text = self._lib.ncclGetErrorString(result).decode(errors="replace")
            raise PeerError(f"NCCL {what} failed: {text} (code {result})")

    def version(self) -> int:
        """NCCL's version code (e.g. 22805 for 2.28.5)."""
        value = ctypes.c_int()
        self._check(self._lib.ncclGetVersion(ctypes.byref(value)), "ncclGetVersion")
        return value.value

    def unique_id(self) -> bytes:
        """A fresh communicator id (rank 0 makes it; the others receive it)."""
        uid = UniqueId()
        self._check(self._lib.ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
        return bytes(uid.internal)

    def init_rank(self, world_size: int, uid: bytes, rank: int) -> int:
        """Create this rank's communicator (blocks until every rank joined)."""
        if len(uid) != 128:
            raise ConfigError(f"NCCL unique id must be 128 bytes, got {len(uid)}")
        handle = ctypes.c_void_p()
        ident = UniqueId()
        ctypes.memmove(ident.internal, uid, 128)
        self._check(self._lib.ncclCommInitRank(ctypes.byref(handle), world_size, ident, rank),
                    "ncclCommInitRank")
        return int(handle.value or 0)

    def broadcast(self, comm: int, ptr: int, nbytes: int, root: int, stream: int) -> None:
        """In-place broadcast of `nbytes` at device address `ptr`, enqueued on `stream`."""
        self._check(self._lib.ncclBroadcast(ptr, ptr, nbytes, NCCL_UINT8, root, comm, stream),
                    "ncclBroadcast")

    def send(self, comm: int, ptr: int, nbytes: int, peer: int, stream: int) -> None:
        """Send `nbytes` at device address `ptr` to rank `peer`, enqueued on `stream`."""
        self._check(self._lib.ncclSend(ptr, nbytes, NCCL_UINT8, peer, comm, stream), "ncclSend")

    def recv(self, comm: int, ptr: int, nbytes: int, peer: int, stream: int) -> None:
        """Receive `nbytes` from rank `peer` into device address `ptr`, on `stream`."""
        self._check(self._lib.ncclRecv(ptr, nbytes, NCCL_UINT8, peer, comm, stream), "ncclRecv")

    def group_start(self) -> None:
        """Open a group: the calls until `group_end` are launched together, as one kernel."""
        self._check(self._lib.ncclGroupStart(), "ncclGroupStart")

    def group_end(self) -> None:
        """Close the group opened by `group_start` and launch its calls."""
        self._check(self._lib.ncclGroupEnd(), "ncclGroupEnd")

    def async_error(self, comm: int) -> int:
        """The communicator's asynchronous error code (0 while healthy)."""
        value = ctypes.c_int()
        self._check(self._lib.ncclCommGetAsyncError(comm, ctypes.byref(value)),
                    "ncclCommGetAsyncError")
        return value.value

    def error_string(self, code: int) -> str:
        """NCCL's text for an error code."""
        return str(self._lib.ncclGetErrorString(code).decode(errors="replace"))

    def abort(self, comm: int) -> None:
        """Tear the communicator down without waiting for peers."""
        self._lib.ncclCommAbort(comm)

    def destroy(self, comm: int) -> None:
        """Release a healthy communicator."""
        self._lib.ncclCommDestroy(comm)


@cache
def load_nccl() -> NCCLLibrary:
    """Find and load libnccl once; `ConfigError` with the install hint when there is none."""
    errors = []
    for path in _candidates():
        try:
            return NCCLLibrary(path)
        except OSError as exc:
            errors.append(f"{path}: {exc}")
    raise ConfigError("cannot load libnccl.so.2 for CUDA tensors: pip install nvidia-nccl-cu12 "
                      "(or -cu13), or set WTRANSFER_NCCL_LIBRARY to its path"
                      + (f"; tried {errors}" if errors else ""))
