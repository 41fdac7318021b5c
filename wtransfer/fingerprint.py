"""Per-tensor digests that prove what a receiver holds, identical on any device."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping

import torch

from wtransfer.packing import byte_view, dtype_name, is_dtensor
from wtransfer.records import Box


def tensor_digest(tensor: torch.Tensor) -> str:
    """Hex BLAKE2b-128 of a tensor's dtype, shape and bytes (DTensors are gathered first)."""
    if is_dtensor(tensor):
        tensor = tensor.full_tensor()
    data = byte_view(tensor.detach()).cpu()
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{dtype_name(tensor.dtype)}{tuple(tensor.shape)}".encode())
    h.update(data.numpy().data)
    return h.hexdigest()


def fingerprint(
    tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
) -> dict[str, str]:
    """Digest of every named tensor: ``{name: hex}``; equal dicts mean bit-identical weights."""
    items = tensors.items() if isinstance(tensors, Mapping) else tensors
    with torch.no_grad():
        return {name: tensor_digest(t) for name, t in items}


_PART = re.compile(r"(?P<name>.+)\[(?P<box>\d+:\d+(?:,\d+:\d+)*)\]")


def part_name(name: str, box: Box) -> str:
    """How a receiver that keeps only `box` of tensor `name` names its digest:
    ``name[start:end,...]`` per dimension."""
    spans = (f"{o}:{o + n}" for o, n in zip(box.offsets, box.lengths, strict=True))
    return f"{name}[{','.join(spans)}]"


def fingerprint_parts(tensors: Mapping[str, torch.Tensor], keys: Iterable[str]
                      ) -> dict[str, str]:
    """What a receiver reporting `keys` (whole names, or `part_name`s of the parts it keeps)
    must report if it holds `tensors`: the digest of each tensor, or of each part of it."""
    out = {}
    with torch.no_grad():
        for key in keys:
            part = _PART.fullmatch(key)
            if key in tensors or part is None:
                out[key] = tensor_digest(tensors[key])
                continue
            spans = [tuple(map(int, s.split(":"))) for s in part["box"].split(",")]
            box = Box(offsets=tuple(a for a, _ in spans), lengths=tuple(b - a for a, b in spans))
            out[key] = tensor_digest(tensors[part["name"]][box.slices()])
    return out


def is_part_name(key: str) -> bool:
    """Whether `key` names a part of a tensor (`part_name`), not a whole one."""
    return _PART.fullmatch(key) is not None
