"""A whole update's copies captured as one CUDA graph (`capture_copies`), replayed by the
updates that read the same sources into the same storages (a `WholeProgram` replayed).

Issued from Python, Qwen3-8B's 400 copies cost a worker 9-13 ms of host time (a Triton launch
each), more than the copying itself; replayed as a graph they are one launch. The graph holds
raw addresses: it lives in its program, which holds every tensor it names, and goes with it
when a storage, the layout or the tensor list changes (docs/architecture.md, "copy graphs").
`WTRANSFER_COPY_GRAPH=0` keeps every update's copies eager (to compare, or to rule it out).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from wtransfer.copies import MEMCPY_BYTES
from wtransfer.receiver.finite import FiniteCheck, checked_copy_kernel, checks_in_copy
from wtransfer.receiver.programs import WholeProgram
from wtransfer.transport.capture_lock import CAPTURING

log = logging.getLogger("wtransfer.receiver.copy_graph")

_STREAMS: dict[torch.device, torch.cuda.Stream] = {}
"""Per device, the side stream copy graphs are captured on."""


def copy_graphs_enabled() -> bool:
    """Whether whole updates replay their copies as CUDA graphs (`WTRANSFER_COPY_GRAPH`, on
    unless "0")."""
    return os.environ.get("WTRANSFER_COPY_GRAPH", "1") != "0"


@dataclass
class CopyGraph:
    """A program's copies as one CUDA graph, and what its replay leaves to check."""

    graph: torch.cuda.CUDAGraph
    checked: list[str]
    """Tensors whose copies check as they copy, in the order of `flags`."""
    flags: torch.Tensor
    """One int32 per checked copy (1: it saw a NaN or an infinity), zeroed by each replay."""
    unchecked: list[tuple[str, torch.Tensor]]
    """(name, values) of contiguous copies the graph made without checking them."""
    checks: bool
    """Whether it was captured to check (with the checked copy where it takes a copy)."""
    verified: bool = False
    """Whether a replay was seen to land every byte (`landed`)."""

    def landed(self, program: WholeProgram) -> bool:
        """Whether every destination of `program` now holds its source's bits (waits for
        the device)."""
        return all(_equal_bits(d, s) for d, s in _pairs(program))


def _equal_bits(a: torch.Tensor, b: torch.Tensor, chunk: int = 1 << 24) -> bool:
    """Whether `a` and `b` (same shape and element size) hold the same bits, compared
    `chunk` rows of their flat views at a time where both are contiguous (no comparison
    temporary the size of a whole tensor)."""
    a, b = _bits(a), _bits(b)
    if not (a.is_contiguous() and b.is_contiguous()):
        return torch.equal(a, b)
    a, b = a.reshape(-1), b.reshape(-1)
    return all(torch.equal(a[i : i + chunk], b[i : i + chunk]) for i in range(0, a.numel(), chunk))


def _pairs(program: WholeProgram) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(destination, source) of every copy of `program`, contiguous then strided."""
    return [(d, s) for _, _, d, s in program.copies] + list(zip(
        program.strided_dests, program.strided_sources, strict=True))


def _bits(values: torch.Tensor) -> torch.Tensor:
    """`values` as integers of its element size (NaN compares equal to itself)."""
    return values.view({1: torch.uint8, 2: torch.int16, 4: torch.int32,
                        8: torch.int64}[values.element_size()])


def capture_copies(program: WholeProgram, device: torch.device, check: bool
                   ) -> CopyGraph | None:
    """`program`'s contiguous and strided copies on CUDA `device` as one graph (checked as
    they copy where `check` and the checked copy takes them), or None where it has none or
    one of them leaves the device. Captured, not run: the caller replays it."""
    copies = program.copies
    pairs = _pairs(program)
    if not pairs or any(d.device != device or s.device != device for d, s in pairs):
        return None
    kernel = checked_copy_kernel() if check else None
    takes = [kernel is not None and checks_in_copy(d, s, dtype, device)
             for _, dtype, d, s in copies]
    flags = torch.zeros(max(1, sum(takes)), dtype=torch.int32, device=device)
    if device not in _STREAMS:
        _STREAMS[device] = torch.cuda.Stream(device)
    stream = _STREAMS[device]
    stream.wait_stream(torch.cuda.current_stream(device))  # (flags made before the capture)
    graph = torch.cuda.CUDAGraph()
    checked: list[str] = []
    unchecked: list[tuple[str, torch.Tensor]] = []
    small: list[tuple[torch.Tensor, torch.Tensor]] = []
    with torch.cuda.device(device), torch.cuda.stream(stream):
        # thread_local: the engine's own thread may step or capture meanwhile
        graph.capture_begin(capture_error_mode="thread_local")
        try:
            flags.zero_()
            for (name, dtype, dst, src), take in zip(copies, takes, strict=True):
                if take:
                    assert kernel is not None
                    kernel.copy_and_flag(dst, src, dtype, flags, len(checked))
                    checked.append(name)
                    continue
                unchecked.append((name, src.view(dtype)))
                if dst.numel() >= MEMCPY_BYTES:
                    dst.copy_(src, non_blocking=True)
                else:
                    small.append((dst, src))
            if small:
                torch._foreach_copy_([d for d, _ in small], [s for _, s in small],
                                     non_blocking=True)
            if program.strided_dests:
                torch._foreach_copy_(program.strided_dests, program.strided_sources,
                                     non_blocking=True)
        finally:
            graph.capture_end()
    return CopyGraph(graph, checked, flags, unchecked, check)


def replay_copies(program: WholeProgram, device: torch.device, finite: FiniteCheck | None
                  ) -> list[tuple[str, torch.Tensor]] | None:
    """Queue `program`'s copies on the current stream as its CUDA graph and return what `finite`
    still has to watch; None where they go eagerly: not run once yet, a host device, graphs off,
    a failed capture, or a first replay whose copies did not land (the program then stays eager)."""
    if device.type != "cuda" or not copy_graphs_enabled() or program.runs < 1 \
            or program.graph_failed:
        return None
    check = finite is not None
    graph = program.graph
    if not isinstance(graph, CopyGraph) or graph.checks != check:
        try:
            with CAPTURING:  # (receivers share the streams; decode graphs capture too)
                graph = capture_copies(program, device, check)
        except Exception as exc:  # (a driver or a kernel that cannot be captured)
            log.warning("capturing an update's copies failed (%s: %s); its copies stay eager",
                        type(exc).__name__, exc)
            graph = None
        program.graph, program.graph_failed = graph, graph is None
        if graph is None:
            return None
    try:
        with torch.cuda.device(device):  # (the current stream of the update's device)
            if not graph.verified:  # the first replay must be seen to write every byte
                for dst, _ in _pairs(program):
                    _bits(dst).bitwise_not_()  # (after the rollback snapshots: same stream)
            graph.graph.replay()
            landed = graph.verified or graph.landed(program)
    except Exception as exc:  # (a replay, or the comparison, failed: out of memory, say)
        log.warning("replaying an update's copies as a CUDA graph failed (%s: %s); they stay "
                    "eager", type(exc).__name__, exc)
        landed = False
    if not landed:
        if not graph.verified:
            log.warning("an update's copies replayed as a CUDA graph did not land; they stay "
                        "eager (WTRANSFER_COPY_GRAPH=0 turns graphs off)")
        program.graph, program.graph_failed = None, True
        return None
    graph.verified = True
    if finite is None:
        return []
    finite.flagged(graph.checked, graph.flags)
    return list(graph.unchecked)
