"""Updates by one-sided reads: each engine worker reads every tensor straight out of the
trainer's memory into its parameter (UCX remote memory access, see `rma`).

The trainer registers each source tensor once, again only when its address or size changes,
and the update call carries what the workers need (a `wtransfer_ucx.info.ReadsUpdate`: the
registrations they do not hold yet, each tensor's address and key, the keys dropped). A
worker checks every read lies inside its key's registration before it writes anything, reads
every tensor (a few at a time when they land in temporaries), and answers once the reads
completed, so `send_weights` returns only when the trainer may write
its tensors again. One call per update, no staging on either side.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from wtransfer.errors import MetadataError
from wtransfer.packing import BucketPlan, TensorMeta
from wtransfer.receiver.session import UpdateSession
from wtransfer.wire import record_to_wire
from wtransfer_ucx.info import ReadsUpdate
from wtransfer_ucx.rma import Reads, Region, RemoteKey


@dataclass(frozen=True)
class _LastExport:
    """The last update's tensor list, its tensors' addresses and its packed ``reads``."""

    metas: Sequence[TensorMeta]
    addresses: list[int]
    reads: bytes


@dataclass(frozen=True)
class _LastSources:
    """The last update's tensor list, packed ``reads`` and the sources they resolved to."""

    names: Sequence[str]
    sizes: Sequence[int]
    reads: bytes
    sources: dict[int, tuple[int, RemoteKey]]


def readable(tensors: list[torch.Tensor]) -> bool:
    """Whether a peer can read every tensor where it lies (contiguous memory)."""
    return all(t.is_contiguous() for t in tensors)


class ExportedTensors:
    """The trainer's registered tensors (see the module docstring)."""

    def __init__(self, context: Any) -> None:
        self._context = context
        self._regions: dict[tuple[int, int], tuple[int, Region]] = {}
        self._next_key = 0
        self._held: set[int] = set()
        """Keys the workers hold (confirmed by a successful update)."""
        self._dropped: list[int] = []
        self._last: _LastExport | None = None
        """A trainer sends the same tensors every step: an update whose list and addresses
        are unchanged reuses the last ``reads`` once the workers confirmed the keys."""
        self._tensors: list[torch.Tensor] = []
        """The registered tensors, referenced until the next update registers others: a
        source's temporaries (quantized copies, say) must not be freed while workers may
        still read their memory."""

    def update(self, tensors: list[torch.Tensor], metas: Sequence[TensorMeta]
               ) -> dict[str, Any]:
        """The ``rma`` field of one update of `tensors` (described by `metas`, in order; a
        sharded rank's tensors are its local shards, each registered at its own size)."""
        addresses = [t.data_ptr() for t in tensors]
        self._tensors = list(tensors)
        last = self._last
        if last is not None and last.metas is metas and last.addresses == addresses and \
                not self._dropped and self._held:
            return record_to_wire(ReadsUpdate(keys=[], reads=last.reads, drop=[]))
        reads = array("q")
        keys: list[tuple[int, int, int, bytes]] = []
        used: dict[tuple[int, int], tuple[int, Region]] = {}
        for tensor, address in zip(tensors, addresses, strict=True):
            span = (address, tensor.numel() * tensor.element_size())
            if not span[1]:
                reads.extend((0, -1))
                continue
            entry = used.get(span) or self._regions.get(span)
            if entry is None:
                entry = (self._next_key, Region(self._context, *span, cuda=tensor.is_cuda))
                self._next_key += 1
            used[span] = entry
            reads.extend((span[0], entry[0]))
        for span, (key, region) in used.items():
            if key not in self._held:
                keys.append((key, span[0], span[1], region.rkey))
        for span, (key, region) in self._regions.items():
            if span not in used:  # the tensor moved: nobody may read this memory any more
                region.close()
                self._dropped.append(key)
        self._regions = used
        self._last = _LastExport(metas, addresses, reads.tobytes())
        return record_to_wire(ReadsUpdate(keys=keys, reads=self._last.reads,
                                          drop=list(self._dropped)))

    def confirm(self) -> None:
        """The update landed: the workers hold every key it used and dropped the old ones."""
        self._held = {key for key, _ in self._regions.values()}
        self._dropped = []

    def forget(self) -> None:
        """The update failed: send every key again next time."""
        self._held = set()

    def close(self) -> None:
        """Unregister everything."""
        for _, region in self._regions.values():
            region.close()
        self._regions = {}
        self._held = set()
        self._tensors = []


class ImportedKeys:
    """A worker's view of the trainer's registrations, unpacked for its endpoint."""

    def __init__(self) -> None:
        self._keys: dict[int, tuple[int, int, RemoteKey]] = {}
        self.in_flight = False
        """True from the first read of an update until every one completed: after a
        failure in between, reads may still land, and only closing the endpoint stops them."""
        self._last: _LastSources | None = None
        """The next update of an unchanged trainer (same list, same addresses, no keys added
        or dropped) reuses the sources checked last time."""

    def read_into(self, session: UpdateSession, plan: BucketPlan, update: ReadsUpdate, ep: Any,
                  device: torch.device, *, budget: int, timeout_s: float,
                  check: Callable[[], None] | None = None) -> None:
        """Check `update` (an update's ``rma`` field) against `plan`, then read every tensor
        into the engine (temporaries up to `budget` bytes at a time)."""
        sources = self.sources([m.name for m in plan.metas], [m.nbytes for m in plan.metas],
                               update, ep, timeout_s)
        if device.type == "cuda":  # the engine's own work on its weights (rollback copies)
            torch.cuda.current_stream(device).synchronize()  # ends before UCX writes them
        landing: list[tuple[Any, torch.Tensor]] = []  # reads into temporaries
        reads, temporary = Reads(ep), 0
        self.in_flight = True
        for bucket in plan.buckets:
            if not bucket.direct:  # only empty tensors are left out of direct buckets
                session.consume(torch.empty(0, dtype=torch.uint8), 0, bucket.slices)
                continue
            extra = session.direct_temporary_bytes(bucket, device)
            if temporary + extra > budget and temporary:
                self._complete(session, reads, landing, timeout_s, check)
                landing, reads, temporary = [], Reads(ep), 0
            destination = session.direct_destination(bucket, device)
            temporary += extra
            address, key = sources[bucket.slices[0].tensor]
            reads.get(destination.data_ptr(), bucket.nbytes, address, key,
                      into_cuda=destination.is_cuda)
            if extra:
                landing.append((bucket, destination))
            else:  # into the parameter itself: nothing left to do with the bytes, so the
                session.complete_direct(bucket, destination)  # books close while they fly
        self._complete(session, reads, landing, timeout_s, check)
        self.in_flight = False

    @staticmethod
    def _complete(session: UpdateSession, reads: Reads, landing: list[tuple[Any, torch.Tensor]],
                  timeout_s: float, check: Callable[[], None] | None) -> None:
        """Wait for `reads`, then load what landed in temporaries (when a read fails the
        update fails whole: rolled back, or the engine marked torn, so the books closed early
        for reads into parameters never count)."""
        reads.finish(timeout_s, check)
        for bucket, destination in landing:
            session.complete_direct(bucket, destination)

    def sources(self, names: Sequence[str], sizes: Sequence[int], update: ReadsUpdate,
                ep: Any, timeout_s: float) -> dict[int, tuple[int, RemoteKey]]:
        """Each non-empty tensor's remote address and key (by its index in `names`, each
        `sizes[i]` bytes where the trainer holds it), every read checked against its key's
        registration first; the keys `update` adds are unpacked for `ep`."""
        last = self._last
        if last is not None and last.names == names and last.sizes == sizes \
                and last.reads == update.reads and not update.keys and not update.drop:
            return last.sources
        self._last = None
        pairs = array("q", update.reads)
        if len(pairs) != 2 * len(names):
            raise MetadataError(f"rma reads describe {len(pairs) // 2} tensors; the update "
                                f"lists {len(names)}")
        for key in update.drop:
            entry = self._keys.pop(key, None)
            if entry is not None:
                entry[2].close()
        new = {key: (address, nbytes, packed) for key, address, nbytes, packed in update.keys}
        wanted: dict[int, tuple[int, int]] = {}
        for index, (name, nbytes) in enumerate(zip(names, sizes, strict=True)):
            address, key = pairs[2 * index], pairs[2 * index + 1]
            if not nbytes:
                continue
            span = new.get(key) or self._keys.get(key)
            if span is None:
                raise MetadataError(f"tensor '{name}' names rma key {key}, which this "
                                    "worker was never sent")
            if not span[0] <= address <= address + nbytes <= span[0] + span[1]:
                raise MetadataError(f"tensor '{name}' ({nbytes} bytes at "
                                    f"{address:#x}) lies outside its rma registration")
            wanted[index] = (address, key)
        if new and not self._keys:  # the endpoint's first keys: finish connecting first
            Reads(ep).finish(timeout_s)  # (a flush completes once the connection is up)
        for key, (address, nbytes, packed) in new.items():  # all checked: unpack
            old = self._keys.pop(key, None)
            if old is not None:
                old[2].close()
            self._keys[key] = (address, nbytes, RemoteKey(ep, packed))
        sources = {i: (address, self._keys[key][2]) for i, (address, key) in wanted.items()}
        self._last = _LastSources(list(names), list(sizes), update.reads, sources)
        return sources

    def close(self) -> None:
        """Release every key (before the endpoint closes)."""
        for _, _, key in self._keys.values():
            key.close()
        self._keys = {}
        self._last = None
        self.in_flight = False
