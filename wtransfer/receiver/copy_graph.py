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

from wtransfer.receiver.finite import FiniteCheck, checked_copy_kernel, checks_in_copy
from wtransfer.receiver.programs import WholeProgram
from wtransfer.transport.copies import MEMCPY_BYTES

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

    def replay(self, finite: FiniteCheck | None) -> list[tuple[str, torch.Tensor]]:
        """Queue every copy on the current stream; hand the copies' flags to `finite` and
        return what it still has to watch."""
        self.graph.replay()
        if finite is None:
            return []
        finite.flagged(self.checked, self.flags)
        return list(self.unchecked)


def capture_copies(program: WholeProgram, device: torch.device, check: bool
                   ) -> CopyGraph | None:
    """`program`'s contiguous and strided copies on CUDA `device` as one graph (checked as
    they copy where `check` and the checked copy takes them), or None where it has none or
    one of them leaves the device. Captured, not run: the caller replays it."""
    copies = program.copies
    pairs = [(d, s) for _, _, d, s in copies] + list(zip(
        program.strided_dests, program.strided_sources, strict=True))
    if not pairs or any(d.device != device or s.device != device for d, s in pairs):
        return None
    kernel = checked_copy_kernel() if check else None
    takes = [kernel is not None and checks_in_copy(d, s, dtype, device)
             for _, dtype, d, s in copies]
    flags = torch.zeros(max(1, sum(takes)), dtype=torch.int32, device=device)
    stream = _STREAMS.setdefault(device, torch.cuda.Stream(device))
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


def graph_for(program: WholeProgram, device: torch.device, check: bool) -> CopyGraph | None:
    """The graph `program`'s copies replay as: captured at its first replay (its first run
    compiled every kernel it launches), None while it has not been replayed, on a host
    device, where graphs are off, or where a capture failed (then it stays eager)."""
    if device.type != "cuda" or not copy_graphs_enabled() or program.runs < 1:
        return None
    if program.graph is None and not program.graph_failed:
        try:
            program.graph = capture_copies(program, device, check)
        except Exception as exc:  # (a driver or a kernel that cannot be captured)
            log.warning("capturing an update's copies failed (%s: %s); its copies stay eager",
                        type(exc).__name__, exc)
            program.graph = None
        program.graph_failed = program.graph is None
    graph = program.graph
    return graph if isinstance(graph, CopyGraph) and graph.checks == check else None
