"""Byte copies between flat uint8 tensors: host memcpy, and CUDA copies kept ahead of the GPU.

`copy_bytes` copies a list at once. `CopyQueue` takes copies one at a time as a receiver
works out where each tensor goes, and issues them in groups while it is still working, so the
device starts copying at once and is never left waiting for the host:

- groups double in size (1, 2, 4, ... up to `GROUP_MAX` copies), so the first copy leaves
  after one tensor's bookkeeping and later groups cost one stream switch each;
- large copies (at least `MEMCPY_BYTES`) go out one device memcpy each, to whichever of
  its streams (`STREAMS`, or `WHOLE_UPDATE_STREAMS` for a whole model's copies: the current
  one and side streams) has the fewest bytes queued, so
  several copies are always in flight (one's ramp-up and tail overlap the others' bodies);
  the side streams start after what the current stream queued before the first group
  (`fenced`: before each group, for a caller that queues its own work on the current stream
  between copies, such as a rollback copy of the next destination), and the current stream
  waits for them at `close`: ordered like one stream;
- small copies (norms, biases) are gathered into one multi-tensor launch at `close` (hundreds
  of them cost one launch); the multi-tensor kernel copies byte by byte, several times slower
  than a memcpy on gigabytes, so it takes only those.

On one H200 (Qwen3-8B, 399 tensors, 16.4 GB): one flat copy of every byte 7.6-7.7 ms, the
399 copies one by one on one stream 8.8-9.0 ms, through a queue over two streams 7.88-8.04,
over four 7.80-7.96 (three runs; one multi-tensor launch for all: 17.0-17.5).
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

MEMCPY_BYTES = 1 << 20
"""On CUDA, copies of at least this many bytes go out one by one as device memcpys."""

GROUP_MAX = 32
"""Most copies a `CopyQueue` holds back before issuing them (the host works out the next
group while the device copies this one)."""

HOST_COPY_THREADS = max(1, min(8, (os.cpu_count() or 1) // 2))
"""Threads one host-memory copy is split over: one on a small machine (the other side of the
pipeline needs the other cores), up to 8 on a large host (one memcpy thread moves a fraction
of its memory bandwidth)."""
_HOST_CHUNK = 8 << 20
_host_pool: ThreadPoolExecutor | None = None
_host_pool_lock = threading.Lock()
STREAMS = 2
"""Streams a `CopyQueue` spreads its large copies over by default: the current one and a
side stream (a packed bucket's few dozen copies; the setting under which the packed path
measured 1.08x two copies on one H200)."""
WHOLE_UPDATE_STREAMS = 4
"""Streams for a queue that carries a whole model's copies (a zero-copy update): on one
H200, 8B's 399 copies took 7.80-7.96 ms over four streams against 7.88-8.04 over two, in
each of three runs."""
_SIDE_STREAMS: dict[torch.device, list[torch.cuda.Stream]] = {}


def copy_host(pairs: Sequence[tuple[int, int, int]]) -> None:
    """memmove each (destination address, source address, nbytes) of host memory, over
    `HOST_COPY_THREADS` threads in chunks when the total is large (ctypes drops the GIL for
    each call). The caller vouches for the addresses."""
    global _host_pool
    total = sum(n for _, _, n in pairs)
    if HOST_COPY_THREADS == 1 or total < 2 * _HOST_CHUNK:
        for dst, src, n in pairs:
            ctypes.memmove(dst, src, n)
        return
    chunks = [(dst + at, src + at, min(_HOST_CHUNK, n - at))
              for dst, src, n in pairs for at in range(0, n, _HOST_CHUNK)]
    with _host_pool_lock:
        if _host_pool is None:
            _host_pool = ThreadPoolExecutor(HOST_COPY_THREADS,
                                            thread_name_prefix="wtransfer-copy")
    share = -(-len(chunks) // HOST_COPY_THREADS)

    def run(part: list[tuple[int, int, int]]) -> None:
        for dst, src, n in part:
            ctypes.memmove(dst, src, n)

    for done in [_host_pool.submit(run, chunks[i:i + share])
                 for i in range(0, len(chunks), share)]:
        done.result()


def _side_streams(device: torch.device, count: int) -> list[torch.cuda.Stream]:
    """`count` side streams of `device`, made once and shared by every queue."""
    sides = _SIDE_STREAMS.setdefault(device, [])
    while len(sides) < count:
        sides.append(torch.cuda.Stream(device))
    return sides[:count]


class CopyQueue:
    """Copies of flat uint8 tensors, issued in growing groups as they are added (see the module
    docstring); `close` issues the rest. Until then a copy may not have been issued: read a
    destination only after `close` (and, on a device, after the stream ran it)."""

    def __init__(self, *, fenced: bool = False, streams: int = STREAMS) -> None:
        if streams < 1:
            raise ValueError(f"CopyQueue: streams must be at least 1, got {streams}")
        self._fenced = fenced
        """Whether each group's side copies wait for everything the current stream queued
        before the group, not only before the first one (that wait also holds them behind
        the current stream's copies of earlier groups)."""
        self._held: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._small: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._group = 1
        """Copies held back before the next group goes out."""
        self._device: torch.device | None = None
        """The CUDA device of the queue's first device copy: streams are that device's."""
        self._streams: list[torch.cuda.Stream] | None = None
        """The current stream, then the side streams (from the first group on)."""
        self._queued = [0] * streams
        """Bytes of large copies queued on each stream."""

    def add(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy `src` into `dst` (flat uint8, same length): on one CUDA device with a later
        group (or the small ones' launch); elsewhere issued at once (host to host is done on
        return; a copy that involves a device is queued on its current stream)."""
        if dst.numel() != src.numel():
            raise ValueError(f"copy_bytes: {src.numel()} bytes into {dst.numel()}")
        device = dst.device
        if self._device is None and dst.is_cuda:
            self._device = device
        if device == self._device and src.device == device:
            if dst.numel() < MEMCPY_BYTES:
                self._small.append((dst, src))
                return
            self._held.append((dst, src))
            if len(self._held) >= self._group:
                self._issue()
                self._group = min(2 * self._group, GROUP_MAX)
        elif dst.is_cpu and src.is_cpu:
            copy_host([(dst.data_ptr(), src.data_ptr(), dst.numel())])
        else:  # between host and device, across devices (or another device than the first)
            dst.copy_(src, non_blocking=True)

    def close(self) -> None:
        """Issue every copy still held; on a device, the current stream then holds them all."""
        self._issue()
        if self._small:
            torch._foreach_copy_([d for d, _ in self._small], [s for _, s in self._small],
                                 non_blocking=True)
            self._small = []
        self._join()

    def abort(self) -> None:
        """Drop the copies not issued yet (the caller failed part-way); the current stream
        still waits for the side stream's, so whatever the caller queues next (a rollback,
        the next update's copies) comes after every copy that did go out."""
        self._held, self._small = [], []
        self._join()

    def _join(self) -> None:
        """The current stream waits for every side copy issued so far."""
        if self._streams is not None:
            current, *sides = self._streams
            for side in sides:
                current.wait_stream(side)
            self._streams = None

    def _issue(self) -> None:
        """The held copies (large, one device): each on the stream with fewest bytes queued."""
        held, self._held = self._held, []
        if not held:
            return
        first = self._streams is None
        if self._streams is None:
            assert self._device is not None  # set by the first copy held
            self._streams = [torch.cuda.current_stream(self._device),
                             *_side_streams(self._device, len(self._queued) - 1)]
        current, *sides = self._streams
        if first or self._fenced:
            for side in sides:
                side.wait_stream(current)
        queued = self._queued
        shares: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in queued]
        for d, s in held:
            which = queued.index(min(queued))
            queued[which] += d.numel()
            shares[which].append((d, s))
        for d, s in shares[0]:
            d.copy_(s, non_blocking=True)
        for side, share in zip(sides, shares[1:], strict=True):
            if share:
                with torch.cuda.stream(side):
                    for d, s in share:
                        d.copy_(s, non_blocking=True)


def copy_bytes(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
    """Copy each flat uint8 `srcs[i]` into the flat uint8 `dsts[i]` of the same length. CPU to CPU
    is a memcpy that drops the GIL (split over `HOST_COPY_THREADS` when large); on one CUDA device
    the copies go out through `CopyQueue`, all on the current stream when this returns."""
    if len(dsts) != len(srcs):
        raise ValueError(f"copy_bytes: {len(srcs)} sources for {len(dsts)} destinations")
    for d, s in zip(dsts, srcs, strict=True):  # every pair, before any copy goes out
        if d.numel() != s.numel():
            raise ValueError(f"copy_bytes: {s.numel()} bytes into {d.numel()}")
    if all(d.is_cpu and s.is_cpu for d, s in zip(dsts, srcs, strict=True)):
        copy_host([(d.data_ptr(), s.data_ptr(), d.numel()) for d, s in zip(dsts, srcs,
                                                                           strict=True)])
        return
    queue = CopyQueue()
    for d, s in zip(dsts, srcs, strict=True):
        queue.add(d, s)
    queue.close()
