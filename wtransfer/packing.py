"""Packed-bucket serialization: many tensors move as a few large aligned byte buffers.

`BucketPlan.build` is a pure function of the tensor metadata and the bucket size, so sender and
receiver compute the same layout independently. Every tensor starts at an `align`-byte offset;
a tensor larger than a bucket is split across consecutive buckets at byte granularity, which
bounds staging memory on each side by `num_buffers * bucket_bytes` whatever the model holds.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeGuard

import torch

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

from wtransfer import wire
from wtransfer.copies import copy_bytes, copy_host
from wtransfer.errors import ConfigError, MetadataError

DEFAULT_ALIGN = 256
"""Byte alignment of every tensor inside a bucket (covers every dtype and vector loads)."""

MAX_DIMS = 32
MAX_NAME_LEN = 1024
MAX_TENSOR_BYTES = 1 << 46
"""Largest single tensor the decoder accepts (64 TiB): catches hostile shapes before allocation."""

_DTYPE_NAMES = (
    "float64", "float32", "float16", "bfloat16", "complex64", "complex128",
    "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "bool",
    "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu",
)  # fmt: skip
DTYPES: dict[str, torch.dtype] = {n: getattr(torch, n) for n in _DTYPE_NAMES if hasattr(torch, n)}
"""Every dtype that can travel, by its name without the ``torch.`` prefix."""


def is_dtensor(tensor: torch.Tensor) -> TypeGuard[DTensor]:
    """Whether `tensor` is a DTensor (a shard of a tensor spread over ranks): the one test
    every module uses (sources, gathers, fingerprints). No DTensor exists before its module
    is imported, so a process that never imports it (a receiver, an engine) does not pay for
    the import (about 0.7 s of CPU, sympy included) to ask."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of a torch dtype (``torch.bfloat16`` -> ``"bfloat16"``)."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise MetadataError(f"dtype {dtype} cannot be transferred; supported: {sorted(DTYPES)}")
    return name


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype for a wire name; unknown names raise `MetadataError`."""
    try:
        return DTYPES[name]
    except (KeyError, TypeError):
        raise MetadataError(f"unknown dtype {name!r}; supported: {sorted(DTYPES)}") from None


@dataclass(frozen=True, slots=True)
class TensorMeta:
    """Name, dtype (wire name) and shape of one tensor; validated on construction."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    _nbytes: int = field(default=0, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not 0 < len(self.name) <= MAX_NAME_LEN:
            raise MetadataError(f"tensor name must be a non-empty string of at most "
                                f"{MAX_NAME_LEN} characters, got {self.name!r:.80}")
        torch_dtype(self.dtype)
        if not isinstance(self.shape, tuple) or len(self.shape) > MAX_DIMS:
            raise MetadataError(f"tensor {self.name!r}: shape must be a tuple of at most "
                                f"{MAX_DIMS} dims, got {self.shape!r:.80}")
        for dim in self.shape:
            if not isinstance(dim, int) or isinstance(dim, bool) or dim < 0:
                raise MetadataError(f"tensor {self.name!r}: shape {self.shape} has a bad dim")
        object.__setattr__(self, "_nbytes", math.prod(self.shape) * DTYPES[self.dtype].itemsize)
        if self.nbytes > MAX_TENSOR_BYTES:
            raise MetadataError(f"tensor {self.name!r}: {self.nbytes} bytes exceeds the limit")

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> TensorMeta:
        """Metadata of `tensor` under `name` (works for DTensors without materializing)."""
        return cls(name, dtype_name(tensor.dtype), tuple(int(d) for d in tensor.shape))

    @property
    def numel(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return DTYPES[self.dtype].itemsize

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor's contents."""
        return self._nbytes

    def to_wire(self) -> list[object]:
        """Compact plain form: ``[name, dtype, [dims...]]``."""
        return [self.name, self.dtype, list(self.shape)]

    @classmethod
    def from_wire(cls, item: object) -> TensorMeta:
        """Parse the compact form, raising `MetadataError` on anything malformed."""
        if not isinstance(item, (list, tuple)) or len(item) != 3:
            raise MetadataError(f"tensor metadata must be [name, dtype, shape], got {item!r:.80}")
        name, dtype, shape = item
        if not isinstance(shape, (list, tuple)):
            raise MetadataError(f"tensor {name!r:.80}: shape must be a list, got {shape!r:.80}")
        return cls(name, dtype, tuple(shape))


def metas_to_wire(metas: Iterable[TensorMeta]) -> list[list[object]]:
    """Plain form of a metadata list."""
    return [m.to_wire() for m in metas]


def metas_from_wire(items: object, *, max_items: int = 1 << 20) -> list[TensorMeta]:
    """Parse a metadata list; duplicate names and oversized lists raise `MetadataError`."""
    if not isinstance(items, (list, tuple)):
        raise MetadataError(f"tensor list must be a list, got {type(items).__name__}")
    if len(items) > max_items:
        raise MetadataError(f"{len(items)} tensors exceeds the limit of {max_items}")
    metas = [TensorMeta.from_wire(x) for x in items]
    seen: set[str] = set()
    for m in metas:
        if m.name in seen:
            raise MetadataError(f"tensor {m.name!r} appears twice in one update")
        seen.add(m.name)
    return metas


@dataclass(frozen=True, slots=True)
class Slice:
    """`nbytes` bytes of tensor `tensor` (an index into the plan's metas), from byte
    `tensor_offset` of that tensor, placed at byte `offset` of a bucket."""

    tensor: int
    tensor_offset: int
    offset: int
    nbytes: int

    def to_wire(self) -> list[int]:
        """Plain form: ``[tensor, tensor_offset, offset, nbytes]``."""
        return [self.tensor, self.tensor_offset, self.offset, self.nbytes]

    @classmethod
    def from_wire(cls, item: object) -> Slice:
        """Parse the plain form; range checks against a bucket happen on receipt."""
        if (
            not isinstance(item, (list, tuple))
            or len(item) != 4
            or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in item)
        ):
            raise MetadataError(f"slice must be 4 non-negative ints, got {item!r:.80}")
        return cls(*item)


@dataclass(frozen=True, slots=True)
class Bucket:
    """One bucket: its index, the bytes in use, and the slices it carries in order. A `direct`
    bucket is one whole tensor moved from the sender's tensor into the receiver's, with no staging
    copy on either side (see `BucketPlan.build`)."""

    index: int
    nbytes: int
    slices: tuple[Slice, ...]
    direct: bool = False


@dataclass(frozen=True, slots=True)
class BucketPlan:
    """The deterministic layout of a list of tensors into buckets of at most `bucket_bytes`."""

    metas: tuple[TensorMeta, ...]
    bucket_bytes: int
    align: int
    buckets: tuple[Bucket, ...]
    direct_threshold: int = 0
    total_bytes: int = field(init=False, repr=False, compare=False)
    """Bytes of tensor contents (padding excluded)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "total_bytes", sum(m.nbytes for m in self.metas))

    def owners(self, senders: int) -> list[int]:
        """Which of `senders` trainer ranks sends each bucket: contiguous runs of buckets
        holding about equal bytes. Both sides compute the same list from the same plan."""
        if senders < 1:
            raise ConfigError(f"senders must be >= 1, got {senders}")
        if senders == 1:
            return [0] * len(self.buckets)
        total = sum(b.nbytes for b in self.buckets) or 1
        owners, before = [], 0
        for bucket in self.buckets:
            owners.append(min(senders - 1, (2 * before + bucket.nbytes) * senders // (2 * total)))
            before += bucket.nbytes
        return owners

    @classmethod
    def build(
        cls, metas: Sequence[TensorMeta], bucket_bytes: int, align: int = DEFAULT_ALIGN,
        direct_threshold: int = 0,
    ) -> BucketPlan:
        """Lay out `metas` in order; both sides get the same plan from the same inputs. With
        `direct_threshold` > 0 a tensor of at least that many bytes is a `direct` bucket of its own
        (moved without staging copies where the backend can); smaller tensors are still packed."""
        if not isinstance(align, int) or align < 1 or align & (align - 1):
            raise ConfigError(f"align must be a positive power of two, got {align!r}")
        if not isinstance(bucket_bytes, int) or bucket_bytes < align:
            raise ConfigError(f"bucket_bytes must be an int >= align ({align}), "
                              f"got {bucket_bytes!r}")
        if direct_threshold < 0:
            raise ConfigError(f"direct_threshold must be >= 0, got {direct_threshold}")
        builder = _PlanBuilder(bucket_bytes, align)
        for index, meta in enumerate(metas):
            if direct_threshold and meta.nbytes >= direct_threshold:
                builder.place_direct(index, meta.nbytes)
            else:
                builder.place(index, meta.nbytes)
        return cls(tuple(metas), bucket_bytes, align, builder.finish(), direct_threshold)


class _PlanBuilder:
    def __init__(self, bucket_bytes: int, align: int) -> None:
        self.capacity = bucket_bytes
        self.align = align
        self.buckets: list[Bucket] = []
        self.slices: list[Slice] = []
        self.cursor = 0

    def _aligned(self) -> int:
        return -(-self.cursor // self.align) * self.align

    def _close(self) -> None:
        if self.slices:
            self.buckets.append(Bucket(len(self.buckets), self.cursor, tuple(self.slices)))
        self.slices, self.cursor = [], 0

    def _add(self, index: int, tensor_offset: int, offset: int, nbytes: int) -> None:
        self.slices.append(Slice(index, tensor_offset, offset, nbytes))
        self.cursor = offset + nbytes

    def place(self, index: int, nbytes: int) -> None:
        if nbytes == 0:  # nothing to copy: recorded at the cursor so the receiver sees it
            self.slices.append(Slice(index, 0, self.cursor, 0))
            return
        start = self._aligned()
        if start + nbytes <= self.capacity:
            self._add(index, 0, start, nbytes)
            return
        if nbytes <= self.capacity:
            self._close()
            self._add(index, 0, 0, nbytes)
            return
        if start >= self.capacity:
            self._close()
            start = 0
        done = 0
        while done < nbytes:
            take = min(nbytes - done, self.capacity - start)
            self._add(index, done, start, take)
            done += take
            if done < nbytes:
                self._close()
                start = 0

    def place_direct(self, index: int, nbytes: int) -> None:
        self._close()
        self.buckets.append(Bucket(len(self.buckets), nbytes, (Slice(index, 0, 0, nbytes),),
                                   direct=True))

    def finish(self) -> tuple[Bucket, ...]:
        self._close()
        return tuple(self.buckets)


def byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a tensor's contents (copies only if it is not contiguous)."""
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    flat = tensor.reshape(-1)
    return flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat


def tensor_from_bytes(data: torch.Tensor, meta: TensorMeta) -> torch.Tensor:
    """View `nbytes` of uint8 `data` as the tensor `meta` describes (no copy)."""
    return data.view(DTYPES[meta.dtype]).reshape(meta.shape)


def signature(tensors: Iterable[torch.Tensor]) -> tuple[list[torch.Size], list[torch.dtype]]:
    """Every tensor's shape and dtype, as two lists: what a sender or an engine compares (in
    two list comparisons) to see that a tensor list it checked before still holds."""
    tensors = list(tensors)
    return [t.shape for t in tensors], [t.dtype for t in tensors]


class BucketPacker:
    """Packs a plan's buckets in order from a tensor iterator, one source tensor live at a time.
    A source that does not yield exactly the announced tensors, in order, with the announced dtype
    and shape, is a `MetadataError` on the sender (not a hang or garbage on the receiver)."""

    def __init__(self, plan: BucketPlan, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        self._plan = plan
        self._iter: Iterator[tuple[str, torch.Tensor]] = iter(tensors)
        self._index = -1
        self._tensor: torch.Tensor | None = None
        self._bytes: torch.Tensor | None = None
        self._finished = False

    def _tensor_bytes(self, index: int) -> torch.Tensor:
        self._advance(index)
        if self._bytes is None:
            assert self._tensor is not None
            self._bytes = byte_view(self._tensor)
        return self._bytes

    def _advance(self, index: int) -> None:
        """Take source tensors up to number `index`, each checked against the plan."""
        while self._index < index:
            meta = self._plan.metas[self._index + 1]
            try:
                name, tensor = next(self._iter)
            except StopIteration:
                raise MetadataError(f"source ended before tensor {meta.name!r} it announced") \
                    from None
            if (name != meta.name or tensor.dtype != DTYPES[meta.dtype]
                    or tensor.shape != meta.shape):
                raise MetadataError(
                    f"source yielded {name!r} {str(tensor.dtype)[6:]}{list(tensor.shape)} but "
                    f"announced {meta.name!r} {meta.dtype}{list(meta.shape)}; the source must "
                    "iterate exactly the tensors of its metadata(), in order")
            self._index += 1
            self._tensor = tensor.detach() if tensor.requires_grad else tensor
            self._bytes = None

    def direct(self, bucket: Bucket) -> torch.Tensor:
        """The source bytes of a `direct` bucket (its one whole tensor), without copying."""
        return self._tensor_bytes(bucket.slices[0].tensor)

    def pack(self, bucket: Bucket, staging: torch.Tensor) -> None:
        """Copy `bucket`'s slices into the uint8 `staging` buffer."""
        if staging.dtype != torch.uint8 or staging.dim() != 1 or not staging.is_contiguous() \
                or staging.numel() < bucket.nbytes:
            raise ConfigError(f"staging must be a flat contiguous uint8 tensor of at least "
                              f"{bucket.nbytes} bytes")
        host = staging.is_cpu
        base = staging.data_ptr()
        pairs: list[tuple[int, int, int]] = []  # host into host: by address, no views (they
        held: list[torch.Tensor] = []  # cost more than copying a small tensor); the tensors
        dsts, srcs = [], []  # held until copied (a source may make each as it yields it)
        for s in bucket.slices:
            self._advance(s.tensor)
            tensor = self._tensor
            assert tensor is not None
            if not s.nbytes:
                continue
            if s.tensor_offset + s.nbytes > tensor.nbytes or s.offset + s.nbytes > bucket.nbytes:
                raise MetadataError(f"slice of tensor #{s.tensor} lies outside it or its bucket")
            if host and tensor.is_cpu and tensor.is_contiguous():
                pairs.append((base + s.offset, tensor.data_ptr() + s.tensor_offset, s.nbytes))
                held.append(tensor)
            else:
                src = self._tensor_bytes(s.tensor)
                dsts.append(staging[s.offset : s.offset + s.nbytes])
                srcs.append(src[s.tensor_offset : s.tensor_offset + s.nbytes])
        copy_host(pairs)
        copy_bytes(dsts, srcs)

    def pack_framed(self, bucket: Bucket, staging: torch.Tensor, checksum: bool) -> torch.Tensor:
        """`pack`, then (with `checksum`) the checksum trailer; returns the bytes to send.

        For backends whose data channel carries the checksum with the bucket (staging needs
        `CHECKSUM_BYTES` to spare)."""
        self.pack(bucket, staging)
        return frame(staging, bucket.nbytes, checksum)

    def walk(self) -> list[torch.Tensor]:
        """Every source tensor, checked against the plan, in order (for a backend that moves
        the tensors themselves rather than packed buckets); then `finish`."""
        tensors = []
        for index in range(len(self._plan.metas)):
            self._advance(index)
            assert self._tensor is not None
            tensors.append(self._tensor)
        self.finish()
        return tensors

    def release(self) -> None:
        """Finish without reading the source further: the caller read its tensors another way
        (`WeightSource.held`), which matches the metadata by construction."""
        self._finished = True
        self._bytes = self._tensor = None

    def finish(self) -> None:
        """Check the source yields every announced tensor (those of buckets another sender
        packs included) and nothing beyond; idempotent."""
        if self._finished:
            return
        self._finished = True
        if self._plan.metas:
            self._advance(len(self._plan.metas) - 1)
        self._bytes = self._tensor = None
        extra = next(self._iter, None)
        if extra is not None:
            raise MetadataError(f"source yielded {extra[0]!r} beyond the tensors it announced")


# -- checksum trailer: for backends whose data channel carries the bucket's checksum itself --

CHECKSUM_BYTES = 16
"""Extra staging bytes per buffer for a checksum trailer: up to 7 of padding plus 8."""


def _trailer_at(nbytes: int) -> int:
    return -(-nbytes // 8) * 8


def write_checksum_trailer(staging: torch.Tensor, nbytes: int, checksum: int) -> int:
    """Store `checksum` after the bucket's bytes (8-byte aligned); returns the length to send."""
    at = _trailer_at(nbytes)
    value = torch.tensor([checksum - (1 << 64) if checksum >= 1 << 63 else checksum],
                         dtype=torch.int64)
    staging[at : at + 8].copy_(value.view(torch.uint8))
    return at + 8


def frame(staging: torch.Tensor, nbytes: int, checksum: bool) -> torch.Tensor:
    """The bytes to send of a bucket packed into `staging[:nbytes]`: with `checksum`, its
    checksum trailer is appended (staging needs `CHECKSUM_BYTES` to spare)."""
    length = (write_checksum_trailer(staging, nbytes, bucket_checksum(staging[:nbytes]))
              if checksum else nbytes)
    return staging[:length]


def read_checksum_trailer(staging: torch.Tensor, nbytes: int) -> int:
    """The checksum the sender stored after the bucket."""
    at = _trailer_at(nbytes)
    return int(staging[at : at + 8].cpu().view(torch.int64).item()) & ((1 << 64) - 1)


def trailer_length(nbytes: int, checksum: bool) -> int:
    """Bytes to send for a bucket of `nbytes`, with or without its checksum trailer."""
    return _trailer_at(nbytes) + 8 if checksum else nbytes


_CHECKSUM_CHUNK = 1 << 21  # int64 words per chunk: bounds the temporaries to 16 MiB
_weights_cache: dict[torch.device, torch.Tensor] = {}


def bucket_checksum(data: torch.Tensor) -> int:
    """A 64-bit position-weighted checksum of uint8 `data`, identical on CPU and CUDA: the wrapping
    sum and index-weighted sum of its 64-bit words, folded; it detects flipped, dropped and
    reordered words."""
    n = data.numel()
    whole = n // 8 * 8
    tail = bytes(data[whole:].cpu().tolist()) + b"\0" * ((8 - (n - whole)) % 8)
    words = data[:whole].view(torch.int64)
    weights = _weights_cache.get(data.device)
    if weights is None:
        weights = torch.arange(1, _CHECKSUM_CHUNK + 1, dtype=torch.int64, device=data.device)
        _weights_cache[data.device] = weights
    plain = torch.zeros((), dtype=torch.int64, device=data.device)
    weighted = torch.zeros((), dtype=torch.int64, device=data.device)
    for start in range(0, words.numel(), _CHECKSUM_CHUNK):
        chunk = words[start : start + _CHECKSUM_CHUNK]
        chunk_sum = chunk.sum()
        plain += chunk_sum
        weighted += (chunk * weights[: chunk.numel()]).sum() + start * chunk_sum
    mask = (1 << 64) - 1
    s1, s2 = int(plain.item()) & mask, int(weighted.item()) & mask
    t = int.from_bytes(tail, "little")
    s1 = (s1 + t) & mask
    s2 = (s2 + t * (words.numel() + 1)) & mask
    return (s1 ^ (s2 * 0x9E3779B97F4A7C15 + n)) & mask


RECORD_SLOT = 1024
"""Bytes of a record that travel in the first collective of `gather_records`."""


def gather_records(record: Any, all_gather: Callable[[torch.Tensor], list[torch.Tensor]]
                   ) -> list[Any]:
    """Every rank's plain-data `record` (msgpack, no pickle) through `all_gather` (this rank's
    uint8 tensor -> every rank's, in rank order): one collective when every record fits
    `RECORD_SLOT` bytes (verdicts, most records), else a second of the longest one's size."""
    data = wire.encode(record)
    slot = torch.zeros(8 + RECORD_SLOT, dtype=torch.uint8)
    slot[:8].view(torch.int64)[0] = len(data)
    if len(data) <= RECORD_SLOT:
        slot[8: 8 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    slots = all_gather(slot)
    sizes = [int(part[:8].view(torch.int64)[0]) for part in slots]
    if max(sizes) <= RECORD_SLOT:
        return [wire.decode(part[8: 8 + n].numpy().tobytes())
                for part, n in zip(slots, sizes, strict=True)]
    mine = torch.zeros(max(sizes), dtype=torch.uint8)
    mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return [wire.decode(part[:n].numpy().tobytes())
            for part, n in zip(all_gather(mine), sizes, strict=True)]
