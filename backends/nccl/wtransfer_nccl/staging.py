"""Where a bucket's optional checksum rides: 8 bytes after the bucket, 8-byte aligned."""

from __future__ import annotations

import torch

CHECKSUM_BYTES = 16
"""Extra staging bytes per buffer: up to 7 of padding plus the 8-byte checksum."""


def _slot(nbytes: int) -> int:
    return -(-nbytes // 8) * 8


def write_checksum(staging: torch.Tensor, nbytes: int, checksum: int) -> int:
    """Store `checksum` after the bucket; returns the length to broadcast."""
    at = _slot(nbytes)
    value = torch.tensor([checksum - (1 << 64) if checksum >= 1 << 63 else checksum],
                         dtype=torch.int64)
    staging[at : at + 8].copy_(value.view(torch.uint8))
    return at + 8


def read_checksum(staging: torch.Tensor, nbytes: int) -> int:
    """The checksum the sender stored after the bucket."""
    at = _slot(nbytes)
    return int(staging[at : at + 8].cpu().view(torch.int64).item()) & ((1 << 64) - 1)


def broadcast_length(nbytes: int, checksum: bool) -> int:
    """Bytes each broadcast carries for a bucket of `nbytes`."""
    return _slot(nbytes) + 8 if checksum else nbytes
