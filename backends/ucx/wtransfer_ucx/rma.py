"""Remote memory access on UCXX's own context and endpoints, through UCX's C API.

UCXX's Python API offers tagged, stream and active-message transfers only, but it exposes the
raw handles (`UCXContext.handle`, `UCXEndpoint.handle`) of a context created with
`Feature.RMA`. This module binds the few UCP calls a one-sided read needs: register memory
(`ucp_mem_map`) and pack its remote key on the side that owns it, unpack the key on the side
that reads (`ucp_ep_rkey_unpack`), read (`ucp_get_nbx`) and complete every read of an endpoint
(`ucp_ep_flush_nbx`). UCXX's progress thread progresses the worker; UCXX creates workers
thread-safe (`UCS_THREAD_MODE_MULTI`), so calls from this thread are allowed.
"""

from __future__ import annotations

import ctypes
import os
import time
from collections.abc import Callable
from functools import cache
from typing import Any

from wtransfer.errors import PeerError, TransferTimeout

_VP = ctypes.c_void_p
_UCS_INPROGRESS = 1
_MEM_MAP_ADDRESS_AND_LENGTH = 0b11
_POLL_S = 0.00005


class _MemMapParams(ctypes.Structure):
    _fields_ = [("field_mask", ctypes.c_uint64), ("address", _VP), ("length", ctypes.c_size_t),
                ("flags", ctypes.c_uint), ("prot", ctypes.c_uint),
                ("memory_type", ctypes.c_int), ("exported_memh_buffer", _VP)]


class _RequestParam(ctypes.Structure):
    """`ucp_request_param_t` (UCX reads only the fields `op_attr_mask` names)."""

    _fields_ = [("op_attr_mask", ctypes.c_uint32), ("flags", ctypes.c_uint32),
                ("request", _VP), ("cb", _VP), ("datatype", ctypes.c_uint64),
                ("user_data", _VP), ("reply_buffer", _VP), ("memory_type", ctypes.c_int),
                ("recv_info", _VP), ("memh", _VP)]


_OP_ATTR_FIELD_MEMORY_TYPE = 1 << 6
_MEM_MAP_MEMORY_TYPE = 1 << 4
_MEMORY_TYPE_CUDA = 1
_NO_PARAMS = _RequestParam()
_INTO_CUDA = _RequestParam(op_attr_mask=_OP_ATTR_FIELD_MEMORY_TYPE,
                           memory_type=_MEMORY_TYPE_CUDA)


@cache
def _ucp() -> ctypes.CDLL:
    import libucx

    lib = ctypes.CDLL(os.path.join(os.path.dirname(libucx.__file__), "lib", "libucp.so"))
    lib.ucp_mem_map.argtypes = [_VP, ctypes.POINTER(_MemMapParams), ctypes.POINTER(_VP)]
    lib.ucp_mem_unmap.argtypes = [_VP, _VP]
    lib.ucp_rkey_pack.argtypes = [_VP, _VP, ctypes.POINTER(_VP), ctypes.POINTER(ctypes.c_size_t)]
    lib.ucp_rkey_buffer_release.argtypes = [_VP]
    lib.ucp_ep_rkey_unpack.argtypes = [_VP, ctypes.c_char_p, ctypes.POINTER(_VP)]
    lib.ucp_rkey_destroy.argtypes = [_VP]
    lib.ucp_get_nbx.argtypes = [_VP, _VP, ctypes.c_size_t, ctypes.c_uint64, _VP,
                                ctypes.POINTER(_RequestParam)]
    lib.ucp_get_nbx.restype = _VP
    lib.ucp_ep_flush_nbx.argtypes = [_VP, ctypes.POINTER(_RequestParam)]
    lib.ucp_ep_flush_nbx.restype = _VP
    lib.ucp_request_check_status.argtypes = [_VP]
    lib.ucp_request_free.argtypes = [_VP]
    lib.ucs_status_string.argtypes = [ctypes.c_int]
    lib.ucs_status_string.restype = ctypes.c_char_p
    return lib


def _status_text(status: int) -> str:
    return f"{_ucp().ucs_status_string(status).decode()} ({status})"


def _error_of(pointer: int | None) -> int:
    """The status a `ucs_status_ptr_t` carries: 0 when done, < 0 on error, 1 in progress."""
    if pointer is None:
        return 0
    if pointer >= (1 << 64) - 4096:  # UCS_PTR_IS_ERR: a small negative status
        return pointer - (1 << 64)
    return _UCS_INPROGRESS


class Region:
    """Memory this process registered so peers can read it (`ucp_mem_map`), and its packed
    remote key (plain bytes: it travels on the control plane)."""

    def __init__(self, context: Any, address: int, nbytes: int, *, cuda: bool) -> None:
        params = _MemMapParams(field_mask=_MEM_MAP_ADDRESS_AND_LENGTH, address=address,
                               length=nbytes)
        if cuda:  # said, not detected: UCXX turns UCX's memory-type cache off
            params.field_mask |= _MEM_MAP_MEMORY_TYPE
            params.memory_type = _MEMORY_TYPE_CUDA
        self._context = _VP(context.handle)
        self._memh = _VP()
        status = _ucp().ucp_mem_map(self._context, ctypes.byref(params),
                                    ctypes.byref(self._memh))
        if status:
            raise PeerError(f"UCX could not register {nbytes} bytes at {address:#x}: "
                            f"{_status_text(status)}")
        buffer, size = _VP(), ctypes.c_size_t()
        status = _ucp().ucp_rkey_pack(self._context, self._memh, ctypes.byref(buffer),
                                      ctypes.byref(size))
        if status:
            self.close()
            raise PeerError(f"UCX could not pack a remote key: {_status_text(status)}")
        self.rkey = ctypes.string_at(buffer, size.value)
        _ucp().ucp_rkey_buffer_release(buffer)
        self.address = address
        self.nbytes = nbytes

    def close(self) -> None:
        """Unregister (peers must no longer read it)."""
        if self._memh:
            _ucp().ucp_mem_unmap(self._context, self._memh)
            self._memh = _VP()


class RemoteKey:
    """A peer's packed remote key, unpacked for reads through endpoint `ep`."""

    def __init__(self, ep: Any, packed: bytes) -> None:
        self._handle = _VP()
        status = _ucp().ucp_ep_rkey_unpack(_VP(ep.handle), packed, ctypes.byref(self._handle))
        if status:
            raise PeerError(f"UCX could not unpack the trainer's remote key: "
                            f"{_status_text(status)}")

    def close(self) -> None:
        """Release the key (before its endpoint closes)."""
        if self._handle:
            _ucp().ucp_rkey_destroy(self._handle)
            self._handle = _VP()


class Reads:
    """One-sided reads through one endpoint, completed together by `finish`."""

    def __init__(self, ep: Any) -> None:
        self._ep = _VP(ep.handle)
        self._requests: list[int] = []

    def get(self, local: int, nbytes: int, remote: int, key: RemoteKey, *,
            into_cuda: bool) -> None:
        """Start reading `nbytes` at the peer's `remote` address into local address `local`
        (CUDA memory when `into_cuda`)."""
        request = _ucp().ucp_get_nbx(self._ep, local, nbytes, remote, key._handle,
                                     ctypes.byref(_INTO_CUDA if into_cuda else _NO_PARAMS))
        self._track(request, "read")

    def finish(self, timeout_s: float, check: Callable[[], None] | None = None) -> None:
        """Flush the endpoint and wait for every read, within `timeout_s` (`check()` may raise
        to stop early); `PeerError` if one failed."""
        self._track(_ucp().ucp_ep_flush_nbx(self._ep, ctypes.byref(_NO_PARAMS)), "flush")
        deadline = time.monotonic() + timeout_s
        lib = _ucp()
        try:
            while self._requests:
                status = lib.ucp_request_check_status(self._requests[-1])
                if status != _UCS_INPROGRESS:
                    lib.ucp_request_free(self._requests.pop())
                    if status:
                        raise PeerError(f"UCX read failed (trainer gone?): "
                                        f"{_status_text(status)}")
                    continue
                if check is not None:
                    check()
                if time.monotonic() > deadline:
                    raise TransferTimeout(f"UCX reads did not complete within {timeout_s:g}s: "
                                          "the trainer is gone or stalled")
                time.sleep(_POLL_S)
        finally:
            self.release()

    def release(self) -> None:
        """Drop the requests still tracked (after a failure; UCX completes them on its own
        when the endpoint closes)."""
        lib = _ucp()
        for request in self._requests:
            lib.ucp_request_free(request)
        self._requests = []

    def _track(self, request: int | None, what: str) -> None:
        status = _error_of(request)
        if status < 0:
            raise PeerError(f"UCX could not start a {what}: {_status_text(status)}")
        if status == _UCS_INPROGRESS:
            assert request is not None
            self._requests.append(request)
