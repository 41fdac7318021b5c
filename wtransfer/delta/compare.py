"""The last-sent bits of a model and the comparison of the tensors now against them, a few
large tensors at a time: a handful of device syncs per GiB instead of several per tensor.

The copy lives in one flat buffer per element width, each tensor at an 8-byte-aligned
offset, so a group of consecutive tensors is one run of 8-byte words. On CUDA two Triton
launches per group count and then write the changed elements in order, and the changed
words into the copy (`wtransfer.delta.compare_kernels`, used where it gave the eager ops'
results on a probe): about two reads of the tensors and the copy, one device sync per group.
Elsewhere each tensor is compared against its run word by word into one mask, the changed
words are found with one `nonzero` over the group, gathered, and compared element by element
in one pass, and the copy is brought up to date with one scatter of the changed words.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, TypeVar

import torch

from wtransfer.delta.codec import BITS_VIEW, INDEX_DTYPES, bits, index_dtype_for
from wtransfer.device_kernels import CheckedKernels
from wtransfer.packing import TensorMeta

if TYPE_CHECKING:
    from wtransfer.delta.compare_kernels import GroupTable, Scan

logger = logging.getLogger(__name__)
T = TypeVar("T")

GROUP_BYTES = {"cuda": 512 << 20, "cpu": 64 << 20}
"""Tensors are compared in groups of about this many bytes: large on a GPU (fewer syncs; the
scan's buffers hold up to a sixteenth of a group's elements), smaller on a host (its word
mask, an eighth of the group's bytes, stays in cache)."""
DENSE_WORDS = 0.25
"""A group with more than this fraction of its words changed is compared tensor by tensor
(gathering most of it would cost more than the tensors' own size)."""
SPARSE_WORDS = 1 / 64
"""Below this fraction of changed words, changed words are found among changed groups of
eight words first (one pass over an eighth of the mask)."""


@dataclass(frozen=True)
class Change:
    """What changed in one tensor: `count` elements; their flat indices (ascending; int32 or
    int64) and new bits (the tensor's `bits` dtype), or None for both where more than the
    caller's limit changed."""

    count: int
    index: torch.Tensor | None
    values: torch.Tensor | None
    payload: torch.Tensor | None = None
    """The sparse payload of these indices and values (`codec.encode_sparse`'s bytes, with
    `codec.index_dtype_for`'s indices), where the group was encoded at once (CUDA kernels,
    at most the caller's limit changed), else None."""


@dataclass(frozen=True)
class _Slot:
    name: str
    width: int
    start: int
    """First element in its width's buffer (a multiple of 8 bytes in)."""
    numel: int


@dataclass
class _Launched:
    """A group whose word comparison is queued: its tensors, those compared word by word
    (slot, int64 view, first word in the run) or element by element, and what finishing it
    reads: the word mask of the eager ops, or the kernels' table and scan."""

    group: list[tuple[_Slot, torch.Tensor, torch.Tensor]]
    width: int
    copy_words: torch.Tensor
    by_words: list[tuple[_Slot, torch.Tensor, int]] = field(default_factory=list)
    by_elements: list[tuple[_Slot, torch.Tensor]] = field(default_factory=list)
    mask: torch.Tensor | None = None
    table: GroupTable | None = None
    found: Scan | None = None
    done: torch.cuda.Event | None = None
    """Recorded on the side stream after the scan (None: queued on the current one)."""


def _aligned_numel(numel: int, width: int) -> int:
    lanes = 8 // width
    return -(-numel // lanes) * lanes


class LastSent:
    """The bits of each tensor of `metas` as last sent, on `device` (zeros until `take`)."""

    def __init__(self, metas: Iterable[TensorMeta], device: torch.device) -> None:
        if device.type == "cuda" and device.index is None:  # (compared with tensors')
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        sizes: dict[int, int] = {}
        self._slots: dict[str, _Slot] = {}
        for meta in metas:
            width = meta.itemsize
            start = sizes.get(width, 0)
            self._slots[meta.name] = _Slot(meta.name, width, start, meta.numel)
            sizes[width] = start + _aligned_numel(meta.numel, width)
        self._buffers = {width: torch.zeros(n, dtype=BITS_VIEW[width], device=device)
                         for width, n in sizes.items()}
        self._tables: dict[tuple[int, int, int], GroupTable] = {}
        self._side: torch.cuda.Stream | None = None

    @property
    def nbytes(self) -> int:
        """The tensors' bytes held (the buffers add at most 7 per tensor of alignment)."""
        return sum(slot.numel * slot.width for slot in self._slots.values())

    def view(self, name: str) -> torch.Tensor:
        """`name`'s last-sent bits (a flat view into the copy)."""
        slot = self._slots[name]
        return self._buffers[slot.width].narrow(0, slot.start, slot.numel)

    def take(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy each named tensor in, one at a time as they come."""
        for name, tensor in tensors:
            flat = self._bits(name, tensor)
            self.view(name).copy_(flat)

    def _bits(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor`'s bits on this copy's device, after checking it has its slot's size."""
        slot = self._slots.get(name)
        flat = bits(tensor.detach())
        if slot is None or flat.numel() != slot.numel or flat.element_size() != slot.width:
            raise ValueError(f"{name!r}: {flat.numel()} elements of {flat.element_size()} "
                             f"bytes, the copy holds "
                             f"{'nothing' if slot is None else slot.numel}")
        return flat if flat.device == self.device else flat.to(self.device)

    def changes(self, now: Iterable[tuple[str, torch.Tensor]], limits: Mapping[str, int]
                ) -> Iterator[tuple[str, torch.Tensor, Change]]:
        """(name, tensor as given, what changed) for each named tensor `now` since the copy,
        which then holds it; tensors are held only until their group is compared (a group
        per element width, so interleaved widths do not cut groups short; on CUDA, where
        the next group's comparison runs on a stream of its own while this one's changes
        are gathered, until the group after it is queued too). A tensor with more than
        `limits[name]` changed elements comes without indices; a name that comes twice is
        a ValueError."""
        most = GROUP_BYTES.get(self.device.type, GROUP_BYTES["cpu"])
        forming: dict[int, list[tuple[_Slot, torch.Tensor, torch.Tensor]]] = {}
        sizes: dict[int, int] = {}
        seen: set[str] = set()
        queued: list[_Launched] = []  # compared or being compared, changes not yet gathered
        try:
            for name, tensor in now:
                if name in seen:
                    raise ValueError(f"{name!r} comes twice in one update")
                seen.add(name)
                flat = self._bits(name, tensor)
                slot = self._slots[name]
                group = forming.setdefault(slot.width, [])
                if group and (slot.start != group[-1][0].start
                              + _aligned_numel(group[-1][0].numel, slot.width)
                              or sizes[slot.width] + flat.numel() * slot.width > most):
                    yield from self._queue(queued, group, limits)
                    group = forming[slot.width] = []
                    sizes[slot.width] = 0
                group.append((slot, flat, tensor))
                sizes[slot.width] = sizes.get(slot.width, 0) + flat.numel() * slot.width
            for group in forming.values():
                if group:
                    yield from self._queue(queued, group, limits)
            while queued:
                yield from self._finished(queued.pop(0), limits)
        finally:  # stopped early: nothing the side stream still writes may be freed under it
            for launched in queued:
                if launched.done is not None:
                    torch.cuda.current_stream(self.device).wait_event(launched.done)

    def _queue(self, queued: list[_Launched],
               group: list[tuple[_Slot, torch.Tensor, torch.Tensor]], limits: Mapping[str, int]
               ) -> Iterator[tuple[str, torch.Tensor, Change]]:
        """Queue `group`'s comparison, then gather the changes of every group queued before
        it (and its own, unless its comparison runs on the side stream)."""
        queued.append(self._launch(group, limits))
        while len(queued) > 1 or (queued and queued[-1].done is None):
            yield from self._finished(queued.pop(0), limits)

    def _launch(self, group: list[tuple[_Slot, torch.Tensor, torch.Tensor]],
                limits: Mapping[str, int]) -> _Launched:
        """Queue the word comparison of consecutive tensors of one width (one run of the
        copy): through the kernels on a side stream where they run, else eager ops."""
        width = group[0][0].width
        lanes = 8 // width  # elements per 8-byte word
        buffer = self._buffers[width]
        first = group[0][0].start
        last_slot = group[-1][0]
        end = last_slot.start + _aligned_numel(last_slot.numel, width)
        copy_words = buffer[first:end].view(torch.int64)
        launched = _Launched(group, width, copy_words)
        for slot, flat, _ in group:
            if slot.numel % lanes or flat.data_ptr() % 8:  # not whole 8-byte words
                launched.by_elements.append((slot, flat))
            else:
                launched.by_words.append((slot, flat.view(torch.int64),
                                          (slot.start - first) // lanes))
        if not launched.by_words:
            return launched
        kernels = _kernels_for(buffer.device)
        if kernels is not None:
            def queue() -> tuple[GroupTable, Scan, torch.cuda.Event | None]:
                table = self._table(first, launched.by_words, copy_words.numel(), kernels)
                elements = copy_words.numel() * lanes
                found = kernels.Scan.empty(
                    table, elements, buffer.dtype, _index_dtype(elements),
                    [min(limits[slot.name], slot.numel) for slot, _, _ in launched.by_words])

                def scan() -> None:
                    kernels.scan(table, copy_words, found, width)

                if buffer.device.type != "cuda":  # (Triton's interpreter)
                    scan()
                    return table, found, None
                return table, found, self._on_side(buffer.device, scan)

            queued = _through_kernels(buffer.device, queue)
            if queued is not None:
                launched.table, launched.found, launched.done = queued
                return launched
        launched.mask = mask = torch.empty(copy_words.numel(), dtype=torch.bool,
                                           device=self.device)
        for slot, _ in launched.by_elements:
            word0 = (slot.start - first) // lanes
            mask[word0:word0 + _aligned_numel(slot.numel, width) // lanes].zero_()
        for _, words, word0 in launched.by_words:
            torch.ne(words, copy_words[word0:word0 + words.numel()],
                     out=mask[word0:word0 + words.numel()])
        return launched

    def _on_side(self, device: torch.device, queue: Callable[[], None]) -> torch.cuda.Event:
        """Run `queue` on this copy's side stream on `device`, after what the current stream
        queued (the tensors' last writes); returns the event the current stream waits on
        before it reads the result."""
        if self._side is None:
            self._side = torch.cuda.Stream(device)
        current = torch.cuda.current_stream(device)
        self._side.wait_stream(current)
        try:
            with torch.cuda.stream(self._side):
                queue()
                done = torch.cuda.Event()
                done.record(self._side)
        except BaseException:  # part of it queued: nothing it writes may be freed under it
            current.wait_stream(self._side)
            raise
        return done

    def _finished(self, launched: _Launched, limits: Mapping[str, int]
                  ) -> Iterator[tuple[str, torch.Tensor, Change]]:
        found = self._gathered_changes(launched, limits)
        for slot, _, tensor in launched.group:
            yield slot.name, tensor, found[slot.name]

    def _gathered_changes(self, launched: _Launched, limits: Mapping[str, int]
                          ) -> dict[str, Change]:
        """The changes of a launched group, the copy brought up to date."""
        width, copy_words, by_words = launched.width, launched.copy_words, launched.by_words
        buffer = self._buffers[width]
        if launched.done is not None:
            torch.cuda.current_stream(self.device).wait_event(launched.done)
        out = {slot.name: self._by_elements(slot, flat, limits[slot.name])
               for slot, flat in launched.by_elements}
        if not by_words:
            return out
        if launched.found is not None:
            out.update(self._scanned(launched.found, by_words, limits))
            return out
        assert launched.mask is not None
        found = self._masked(launched.mask, by_words, copy_words, width)
        if found is None:  # most words changed: tensor by tensor, without most indices
            for slot, words, _ in by_words:
                out[slot.name] = self._by_elements(slot, words.view(buffer.dtype),
                                                   limits[slot.name])
            return out
        index, values, counts = found
        out.update(_split(by_words, counts, limits, index, values, [None] * len(by_words),
                          counts))
        return out

    def _scanned(self, found: Scan, by_words: list[tuple[_Slot, torch.Tensor, int]],
                 limits: Mapping[str, int]) -> dict[str, Change]:
        """The changes of a group the kernels scanned, encoded where sparse (the scan
        brought the copy up to date); where more changed than it kept (the copy as it was),
        each tensor by its count: unchanged, sent whole or compared on its own."""
        counts = found.counts.tolist()  # (the group's one sync)
        kept = [c if c <= min(limits[slot.name], slot.numel) else 0
                for (slot, _, _), c in zip(by_words, counts, strict=True)]
        total = sum(kept)
        if total > found.capacity:
            return {slot.name: self._counted(slot, words.view(found.values.dtype), count,
                                             limits[slot.name])
                    for (slot, words, _), count in zip(by_words, counts, strict=True)}
        index, values = found.index[:total], found.values[:total]
        kernels = _kernels_for(self.device)
        payloads = None
        if kernels is not None:
            def encoded() -> list[torch.Tensor | None]:
                owner = torch.repeat_interleave(
                    torch.arange(len(counts), device=self.device), found.kept,
                    output_size=total)
                return _encoded(kernels, by_words, kept, limits, index, values, owner)

            payloads = _through_kernels(self.device, encoded)
        return _split(by_words, counts, limits, index, values,
                      payloads if payloads is not None else [None] * len(by_words), kept)

    def _counted(self, slot: _Slot, flat: torch.Tensor, count: int, limit: int) -> Change:
        """One tensor's change from its count of changed elements alone, its copy brought up
        to date: none, whole past its limit, else compared on its own."""
        if count == 0:
            return Change(0, torch.empty(0, dtype=torch.int64, device=self.device),
                          flat[:0])
        if count > limit:
            self.view(slot.name).copy_(flat)
            return Change(count, None, None)
        return self._by_elements(slot, flat, limit)

    def _masked(self, mask: torch.Tensor, by_words: list[tuple[_Slot, torch.Tensor, int]],
                copy_words: torch.Tensor, width: int
                ) -> tuple[torch.Tensor, torch.Tensor, list[int]] | None:
        """The changed elements of a group compared word by word into `mask` by the eager
        ops (each one's index in its tensor and bits now, in the group's order) and each
        tensor's count, the copy brought up to date; None where more than `DENSE_WORDS` of
        the words changed (the copy as it was)."""
        word = self._changed_words(mask)
        if word is None:
            return None
        lanes = 8 // width
        dtype = self._buffers[width].dtype
        owner, local, now_words, was_words = _gathered(by_words, word, copy_words,
                                                       mask.numel())
        now_lanes, was_lanes = now_words.view(dtype), was_words.view(dtype)
        position = torch.nonzero(now_lanes != was_lanes).squeeze(1)
        values = now_lanes.index_select(0, position)
        in_words = position // lanes
        index = local.index_select(0, in_words).mul_(lanes).add_(position % lanes)
        owner = owner.index_select(0, in_words)
        index = index.to(_index_dtype(copy_words.numel() * lanes))
        counts = _counts(owner, torch.arange(len(by_words) + 1, device=self.device))
        return index, values, counts

    def _table(self, first: int, by_words: list[tuple[_Slot, torch.Tensor, int]], end: int,
               kernels: ModuleType) -> GroupTable:
        """The kernels' table of a group (built again only when a tensor moved)."""
        words = [w for _, w, _ in by_words]
        starts = [w0 for _, _, w0 in by_words]
        width = by_words[0][0].width
        table = self._tables.get((width, first, end))
        if table is None or table.key != kernels.table_key(words, starts):
            table = self._tables[(width, first, end)] = kernels.GroupTable.build(
                words, starts, end, width)
        return table

    def _changed_words(self, mask: torch.Tensor) -> torch.Tensor | None:
        """Ascending positions of `mask`'s true entries; None when more than `DENSE_WORDS`
        of them are (on a host, counted first: that decides how to find them)."""
        if self.device.type == "cpu":
            count = int(torch.count_nonzero(mask))
            if count > DENSE_WORDS * mask.numel():
                return None
            return _nonzero(mask, sparse=count < SPARSE_WORDS * mask.numel())
        word = torch.nonzero(mask).squeeze(1)
        return None if word.numel() > DENSE_WORDS * mask.numel() else word

    def _by_elements(self, slot: _Slot, flat: torch.Tensor, limit: int) -> Change:
        """Compare one tensor element by element (and bring its copy up to date); no
        indices past its limit."""
        last = self.view(slot.name)
        differ = flat != last
        count = int(torch.count_nonzero(differ))
        if count > limit:
            last.copy_(flat)
            return Change(count, None, None)
        index = torch.nonzero(differ).squeeze(1)
        values = flat.index_select(0, index)
        last.index_copy_(0, index, values)
        return Change(int(index.numel()), index, values)


def _gathered(by_words: list[tuple[_Slot, torch.Tensor, int]], word: torch.Tensor,
              copy_words: torch.Tensor, end: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The eager gather of changed run words `word`: (each one's tensor, its word within
    that tensor, its word now, its word in the copy before), the copy then holding the
    words now; a few launches per tensor."""
    starts = torch.tensor([w0 for _, _, w0 in by_words] + [end], device=word.device)
    words_of = _counts(word, starts)
    owner = torch.searchsorted(starts, word, right=True).sub_(1)
    local = word - starts.index_select(0, owner)
    now_words = torch.empty_like(word)
    at = 0
    for (_, words, _), count in zip(by_words, words_of, strict=True):
        if count:
            torch.index_select(words, 0, local[at:at + count], out=now_words[at:at + count])
        at += count
    was_words = copy_words.index_select(0, word)
    copy_words.index_copy_(0, word, now_words)
    return owner, local, now_words, was_words


def _encoded(kernels: ModuleType, by_words: list[tuple[_Slot, torch.Tensor, int]],
             counts: list[int], limits: Mapping[str, int], index: torch.Tensor,
             values: torch.Tensor, owner: torch.Tensor) -> list[torch.Tensor | None]:
    """The sparse payload of each tensor of a group that changed, at most its limit (else
    None), written into one buffer by one launch (each payload 8-byte aligned in it)."""
    width = values.element_size()
    rows: list[list[int]] = [[], [], [], []]  # first element, index at, values at, index width
    spans: list[tuple[int, int] | None] = []
    first = total = 0
    for (slot, _, _), count in zip(by_words, counts, strict=True):
        index_width = 0
        span = None
        if 0 < count <= limits[slot.name]:
            index_width = INDEX_DTYPES[index_dtype_for(slot.numel)].itemsize
            span = (total, count * (index_width + width))
        spans.append(span)
        start = span[0] if span is not None else 0
        for row, value in zip(rows, (first, start, start + count * index_width, index_width),
                              strict=True):
            row.append(value)
        if span is not None:
            total += -(-span[1] // 8) * 8
        first += count
    if not total:
        return [None] * len(by_words)
    out = torch.empty(total, dtype=torch.uint8, device=values.device)
    layout = torch.tensor(rows, dtype=torch.int64).to(values.device)
    kernels.encode(index, values, owner, layout, out)
    return [None if span is None else out.narrow(0, span[0], span[1]) for span in spans]


def _split(by_words: list[tuple[_Slot, torch.Tensor, int]], counts: list[int],
           limits: Mapping[str, int], index: torch.Tensor, values: torch.Tensor,
           payloads: list[torch.Tensor | None], placed: list[int]) -> dict[str, Change]:
    """Each tensor's change (`counts[i]` elements changed) from a group's changed elements,
    where the i-th tensor holds the next `placed[i]` of them; without indices past its
    limit."""
    out = {}
    at = 0
    for (slot, _, _), count, payload, held in zip(by_words, counts, payloads, placed,
                                                 strict=True):
        out[slot.name] = (Change(count, None, None) if count > limits[slot.name] else
                          Change(count, index[at:at + count], values[at:at + count], payload))
        at += held
    return out


def _index_dtype(elements: int) -> torch.dtype:
    """The index dtype of a group's changes: int32 where every index of its run fits."""
    return torch.int32 if elements < 1 << 31 else torch.int64


def _through_kernels(device: torch.device, call: Callable[[], T]) -> T | None:
    """`call()`, which runs the kernels on `device`; None where they fail to compile or
    launch for a shape the probe did not have (the eager ops from then on)."""
    try:
        return call()
    except Exception as exc:
        logger.warning("the Triton delta comparison failed on %s (%s): using the eager one",
                       device, exc)
        _kernels.drop(device)
        return None


def _checked(device: torch.device) -> ModuleType | None:
    try:
        from wtransfer.delta import compare_kernels
        if compare_kernels.works_on(device):
            return compare_kernels
        logger.warning("the Triton delta comparison differs from the eager one on %s: "
                       "using the eager one", device)
    except Exception as exc:  # no Triton, no compiler, a launch error: eager still works
        logger.warning("the Triton delta comparison is unavailable on %s (%s): using the "
                       "eager one", device, exc)
    return None


_kernels = CheckedKernels("WTRANSFER_DELTA_TRITON", _checked)
"""`wtransfer.delta.compare_kernels` on each CUDA device where it gave the eager results on a
probe; eager ops on a host, without Triton, or with ``WTRANSFER_DELTA_TRITON=0``."""
_kernels_for = _kernels.on


def _counts(ascending: torch.Tensor, bounds: torch.Tensor) -> list[int]:
    """How many of `ascending` values lie in each [bounds[i], bounds[i + 1])."""
    return torch.diff(torch.searchsorted(ascending, bounds)).tolist()


def _nonzero(mask: torch.Tensor, sparse: bool) -> torch.Tensor:
    """Ascending int64 positions of `mask`'s true entries; when few, found among its
    nonzero 8-entry groups first (one pass over an eighth of the mask)."""
    if not sparse or mask.numel() % 8:
        return torch.nonzero(mask).squeeze(1)
    groups = mask.view(torch.int64)
    hit = torch.nonzero(groups).squeeze(1)
    within = torch.nonzero(groups.index_select(0, hit).view(torch.bool)).squeeze(1)
    return hit.index_select(0, within // 8) * 8 + within % 8
