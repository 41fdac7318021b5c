"""Per-tensor digests that prove what a receiver holds, identical on any device."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping

import torch

from wtransfer.packing import byte_view, dtype_name, is_dtensor


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
