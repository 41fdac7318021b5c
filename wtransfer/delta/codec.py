"""How one tensor's change travels: which elements differ, and their sparse encoding.

Elements are compared by their bits (an integer view of the same width), so a float whose
value is unchanged but whose bits differ (a NaN payload, -0.0) counts as changed, and a delta
reproduces the sender's bytes exactly. A sparse payload is one flat uint8 tensor: the changed
elements' flat indices in ascending order (uint16 for tensors of at most 65,536 elements, int32
up to 2^31, else int64), then their values, in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from wtransfer.errors import MetadataError
from wtransfer.packing import DTYPES, TensorMeta
from wtransfer.records import DeltaHeader

BITS_VIEW: dict[int, torch.dtype] = {1: torch.uint8, 2: torch.int16, 4: torch.int32,
                                     8: torch.int64}
"""The integer dtype of each element width: elements are compared through it."""

INDEX_DTYPES: dict[str, torch.dtype] = {"uint16": torch.uint16, "int32": torch.int32,
                                        "int64": torch.int64}
DENSE = ""
"""`DeltaEntry.index_dtype` of a tensor sent whole."""


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """A flat integer view of `tensor`'s elements (same width, same bits), copying only when
    it is not contiguous."""
    flat = tensor.detach().reshape(-1)
    return flat.view(BITS_VIEW[flat.element_size()])


def index_dtype_for(numel: int) -> str:
    """The narrowest index dtype that addresses every element of a tensor of `numel`."""
    if numel <= 1 << 16:
        return "uint16"
    return "int32" if numel < 1 << 31 else "int64"


def sparse_nbytes(count: int, index_dtype: str, itemsize: int) -> int:
    """Bytes of a sparse payload of `count` elements of `itemsize` bytes."""
    return count * (INDEX_DTYPES[index_dtype].itemsize + itemsize)


@dataclass(frozen=True)
class DeltaEntry:
    """One changed tensor of a delta: `count` elements differ; sent sparse (`index_dtype`
    names its indices) or whole (`index_dtype` == `DENSE`), in the sender's `dtype`."""

    name: str
    count: int
    index_dtype: str
    dtype: str

    def __post_init__(self) -> None:
        if self.index_dtype != DENSE and self.index_dtype not in INDEX_DTYPES:
            raise MetadataError(f"delta entry {self.name!r}: unknown index dtype "
                                f"{self.index_dtype!r}")
        if not isinstance(self.count, int) or self.count < 0:
            raise MetadataError(f"delta entry {self.name!r}: bad count {self.count!r}")
        if self.dtype not in DTYPES:
            raise MetadataError(f"delta entry {self.name!r}: unknown dtype {self.dtype!r}")

    @property
    def dense(self) -> bool:
        """Whether the tensor travels whole."""
        return self.index_dtype == DENSE

    def wire_meta(self, held: TensorMeta) -> TensorMeta:
        """How this entry travels, for a tensor of `held`'s shape: the tensor itself (in the
        sender's dtype) when dense, else a uint8 payload of the sparse size."""
        if self.dense:
            return TensorMeta(self.name, self.dtype, held.shape)
        if self.count > held.numel:
            raise MetadataError(f"delta entry {self.name!r}: {self.count} changed elements "
                                f"of a tensor of {held.numel}")
        return TensorMeta(self.name, "uint8",
                          (sparse_nbytes(self.count, self.index_dtype,
                                         DTYPES[self.dtype].itemsize),))

    def to_wire(self) -> list[object]:
        """Plain form: ``[name, count, index_dtype, dtype]``."""
        return [self.name, self.count, self.index_dtype, self.dtype]

    @classmethod
    def from_wire(cls, item: object) -> DeltaEntry:
        """Parse `to_wire`'s form (`MetadataError` for anything else)."""
        if (not isinstance(item, (list, tuple)) or len(item) != 4
                or not all(isinstance(item[i], str) for i in (0, 2, 3))
                or not isinstance(item[1], int) or isinstance(item[1], bool)):
            raise MetadataError(f"malformed delta entry {item!r:.120}")
        return cls(item[0], item[1], item[2], item[3])


WORD_FROM = 1 << 16
"""Tensors of at least this many elements are compared eight bytes at a time first."""


def changed(current: torch.Tensor, last: torch.Tensor, limit: int
            ) -> tuple[torch.Tensor | None, int]:
    """(ascending flat int64 indices of the elements of `current` whose bits differ from `last`, a
    `bits` view of the same length on the same device, and how many differ); the indices are None
    when more than `limit` differ (the caller then sends the tensor whole)."""
    now = bits(current)
    width = now.element_size()
    if (width == 8 or now.numel() < WORD_FROM or (now.numel() * width) % 8
            or now.data_ptr() % 8 or last.data_ptr() % 8):
        index = torch.nonzero(now != last).squeeze(1)
        count = int(index.numel())
        return (index if count <= limit else None), count
    lanes = 8 // width
    mask = now.view(torch.int64) != last.view(torch.int64)
    words_changed = int(torch.count_nonzero(mask))
    if words_changed * lanes > limit:  # the changed elements may not fit: count them
        count = int(torch.count_nonzero(now != last))
        if count > limit:
            return None, count
    words = torch.nonzero(mask).squeeze(1)
    rows = (now.view(-1, lanes).index_select(0, words)
            != last.view(-1, lanes).index_select(0, words)).reshape(-1)
    within = torch.nonzero(rows).squeeze(1)
    return words[within // lanes] * lanes + within % lanes, int(within.numel())


def sparse_limit(numel: int, index_dtype: str, itemsize: int) -> int:
    """The most changed elements of a tensor of `numel` that go sparse: while the payload is
    at most half the tensor's bytes (decoding and scattering cost more per byte than a whole
    copy)."""
    return numel * itemsize // (2 * (INDEX_DTYPES[index_dtype].itemsize + itemsize))


def encode_sparse(values: torch.Tensor, index: torch.Tensor, index_dtype: str) -> torch.Tensor:
    """The payload of `values` (bits view, the changed elements) at flat `index`."""
    return torch.cat([index.to(INDEX_DTYPES[index_dtype]).view(torch.uint8),
                      values.view(torch.uint8)])


def _aligned(data: torch.Tensor, width: int) -> torch.Tensor:
    """`data` (uint8), copied when its start is not aligned to `width` (a payload packed
    at any byte of a bucket)."""
    return data if data.storage_offset() % width == 0 else data.clone()


def decode_sparse(payload: torch.Tensor, entry: DeltaEntry, held: TensorMeta
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(int64 flat indices, values as `held`'s bits) of a sparse payload, after checking
    its size and that every index lies in the tensor, ascending, each once."""
    width = INDEX_DTYPES[entry.index_dtype].itemsize
    expected = sparse_nbytes(entry.count, entry.index_dtype, held.itemsize)
    flat = payload.reshape(-1)
    if flat.dtype != torch.uint8 or flat.numel() != expected:
        raise MetadataError(f"delta of {entry.name!r}: payload of {flat.numel()} bytes, "
                            f"expected {expected}")
    split = entry.count * width
    index = _aligned(flat[:split], width).view(INDEX_DTYPES[entry.index_dtype]).to(torch.int64)
    itemsize = DTYPES[held.dtype].itemsize
    values = _aligned(flat[split:], itemsize).view(BITS_VIEW[itemsize])
    if entry.count and (int(index[0]) < 0 or int(index[-1]) >= held.numel
                        or bool((index[1:] <= index[:-1]).any())):
        raise MetadataError(f"delta of {entry.name!r}: indices must ascend within the "
                            f"tensor's {held.numel} elements")
    return index, values


def parsed_entries(header: DeltaHeader) -> list[DeltaEntry]:
    """A delta header's entries, parsed (each name once)."""
    entries = [DeltaEntry.from_wire(item) for item in header.entries]
    if len({e.name for e in entries}) != len(entries):
        raise MetadataError("a delta names a tensor twice")
    return entries
