"""The last-sent bits of a model and the comparison of the tensors now against them, a few
large tensors at a time: a handful of device syncs per GiB instead of several per tensor.

The copy lives in one flat buffer per element width, each tensor at an 8-byte-aligned
offset, so a group of consecutive tensors is one run of 8-byte words: each tensor is
compared against its run word by word into one mask, the changed words are found with one
`nonzero` over the group, gathered, and compared element by element in one pass. The copy
is brought up to date with one scatter of the changed words. On CUDA the comparison and the
gather are one Triton launch each per group (`wtransfer.delta.compare_kernels`, used where it
gave the eager ops' results on a probe) instead of a few launches per tensor.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, TypeVar

import torch

from wtransfer.delta.codec import BITS_VIEW, INDEX_DTYPES, bits, index_dtype_for
from wtransfer.packing import TensorMeta
from wtransfer.transport.device_kernels import CheckedKernels

if TYPE_CHECKING:
    from wtransfer.delta.compare_kernels import GroupTable

logger = logging.getLogger(__name__)
T = TypeVar("T")

GROUP_BYTES = {"cuda": 1 << 30, "cpu": 64 << 20}
"""Tensors are compared in groups of about this many bytes (the word mask of a group is an
eighth of it): large on a GPU (fewer syncs), smaller on a host (the mask stays in cache)."""
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
    reads."""

    group: list[tuple[_Slot, torch.Tensor, torch.Tensor]]
    width: int
    copy_words: torch.Tensor
    mask: torch.Tensor
    by_words: list[tuple[_Slot, torch.Tensor, int]] = field(default_factory=list)
    by_elements: list[tuple[_Slot, torch.Tensor]] = field(default_factory=list)
    table: GroupTable | None = None
    done: torch.cuda.Event | None = None
    """Recorded on the side stream after the comparison (None: queued on the current one)."""


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
        self._tables: dict[tuple[int, int], GroupTable] = {}
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
        """(name, tensor as given, what changed) for each named tensor of `now` since the copy,
        which then holds it. A tensor with more than `limits[name]` changed elements may come
        without indices; a name that comes twice is a `ValueError`."""
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
                    torch.cuda.current_stream(launched.mask.device).wait_event(launched.done)

    def _queue(self, queued: list[_Launched],
               group: list[tuple[_Slot, torch.Tensor, torch.Tensor]], limits: Mapping[str, int]
               ) -> Iterator[tuple[str, torch.Tensor, Change]]:
        """Queue `group`'s comparison, then gather the changes of every group queued before
        it (and its own, unless its comparison runs on the side stream)."""
        queued.append(self._launch(group))
        while len(queued) > 1 or (queued and queued[-1].done is None):
            yield from self._finished(queued.pop(0), limits)

    def _launch(self, group: list[tuple[_Slot, torch.Tensor, torch.Tensor]]) -> _Launched:
        """Queue the word comparison of consecutive tensors of one width (one run of the
        copy): through the kernels on a side stream where they run, else eager ops."""
        width = group[0][0].width
        lanes = 8 // width  # elements per 8-byte word
        buffer = self._buffers[width]
        first = group[0][0].start
        last_slot = group[-1][0]
        end = last_slot.start + _aligned_numel(last_slot.numel, width)
        copy_words = buffer[first:end].view(torch.int64)
        mask = torch.empty(copy_words.numel(), dtype=torch.bool, device=self.device)
        launched = _Launched(group, width, copy_words, mask)
        for slot, flat, _ in group:
            word0 = (slot.start - first) // lanes
            if slot.numel % lanes or flat.data_ptr() % 8:  # not whole 8-byte words
                launched.by_elements.append((slot, flat))
                mask[word0:word0 + _aligned_numel(slot.numel, width) // lanes].zero_()
                continue
            launched.by_words.append((slot, flat.view(torch.int64), word0))
        if not launched.by_words:
            return launched
        kernels = _kernels_for(buffer.device)
        if kernels is not None:
            def queue() -> tuple[GroupTable, torch.cuda.Event | None]:
                table = self._table(first, launched.by_words, mask.numel(), kernels)
                if buffer.device.type != "cuda":  # (Triton's interpreter)
                    kernels.compare(table, copy_words, mask)
                    return table, None
                return table, self._on_side(
                    buffer.device, lambda: kernels.compare(table, copy_words, mask))

            queued = _through_kernels(buffer.device, queue)
            if queued is not None:
                launched.table, launched.done = queued
        if launched.table is None:
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
        width, copy_words, mask = launched.width, launched.copy_words, launched.mask
        by_words, table = launched.by_words, launched.table
        lanes = 8 // width
        buffer = self._buffers[width]
        if launched.done is not None:
            torch.cuda.current_stream(mask.device).wait_event(launched.done)
        out = {slot.name: self._by_elements(slot, flat, limits[slot.name])
               for slot, flat in launched.by_elements}
        if not by_words:
            return out
        word = self._changed_words(mask)
        if word is None:  # most words changed: tensor by tensor, without most indices
            for slot, words, _ in by_words:
                out[slot.name] = self._by_elements(slot, words.view(buffer.dtype),
                                                   limits[slot.name])
            return out
        kernels = _kernels_for(buffer.device)
        gathered = None
        if kernels is not None and table is not None:
            gathered = _through_kernels(buffer.device,
                                        lambda: kernels.gather(table, word, copy_words))
        if gathered is not None and table is not None:
            owner, now_words, was_words = gathered
            local = word - table.starts.index_select(0, owner)
        else:
            owner, local, now_words, was_words = _gathered(by_words, word, copy_words,
                                                           mask.numel())
        now_lanes, was_lanes = now_words.view(buffer.dtype), was_words.view(buffer.dtype)
        position = torch.nonzero(now_lanes != was_lanes).squeeze(1)
        values = now_lanes.index_select(0, position)
        shift = lanes.bit_length() - 1  # (lanes: 1, 2, 4 or 8; shifts cost less than divides)
        in_words = position >> shift
        index = local.index_select(0, in_words).mul_(lanes).add_(position & (lanes - 1))
        owner = owner.index_select(0, in_words)
        if copy_words.numel() * lanes < 1 << 31:  # every index fits the widest common dtype
            index = index.to(torch.int32)
        elements_of = _counts(owner, torch.arange(len(by_words) + 1, device=self.device))
        payloads: list[torch.Tensor | None] | None = None
        if kernels is not None and gathered is not None:
            payloads = _through_kernels(buffer.device, lambda: _encoded(
                kernels, by_words, elements_of, limits, index, values, owner))
        if payloads is None:
            payloads = [None] * len(by_words)
        at = 0
        for (slot, _, _), count, payload in zip(by_words, elements_of, payloads, strict=True):
            out[slot.name] = Change(count, index[at:at + count], values[at:at + count],
                                    payload)
            at += count
        return out

    def _table(self, first: int, by_words: list[tuple[_Slot, torch.Tensor, int]], end: int,
               kernels: ModuleType) -> GroupTable:
        """The kernels' table of a group (built again only when a tensor moved)."""
        words = [w for _, w, _ in by_words]
        starts = [w0 for _, _, w0 in by_words]
        width = by_words[0][0].width
        table = self._tables.get((width, first))
        if table is None or table.key != kernels.table_key(words, starts):
            table = self._tables[(width, first)] = kernels.GroupTable.build(words, starts, end)
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
