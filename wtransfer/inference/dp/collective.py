"""The ranks' cross-process collective: a gloo group formed through the front end's TCPStore.

Every call has the group's deadline: a rank that died or stalled makes the others fail with
`PeerError` / `TransferTimeout` instead of waiting forever.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from wtransfer.errors import PeerError, TransferTimeout


def host_store(host: str, timeout_s: float) -> dist.TCPStore:
    """The front end's store (a free port); ranks rendezvous through it."""
    return dist.TCPStore(host, 0, None, True, timedelta(seconds=timeout_s),
                         wait_for_workers=False)


class RankGroup:
    """A gloo group of the `size` data-parallel ranks; sums small integer vectors."""

    def __init__(self, host: str, port: int, session: str, rank: int, size: int,
                 timeout_s: float) -> None:
        self.size = size
        self.timeout_s = timeout_s
        try:
            store = dist.TCPStore(host, port, None, False, timedelta(seconds=timeout_s))
            prefixed = dist.PrefixStore(f"wtransfer-dp/{session}/", store)
            self._pg = dist.ProcessGroupGloo(prefixed, rank, size, timedelta(seconds=timeout_s))
        except RuntimeError as exc:
            raise TransferTimeout(f"data-parallel rank {rank} could not join the group of "
                                  f"{size} at {host}:{port} within {timeout_s:g}s: {exc}") from None

    def all_reduce(self, values: list[int]) -> list[int]:
        """Element-wise sum of `values` over every rank."""
        buffer = torch.tensor(values, dtype=torch.int64)
        pg: Any = self._pg  # default AllreduceOptions: SUM
        try:
            pg.allreduce([buffer]).wait()
        except RuntimeError as exc:
            text = str(exc)
            if "imeout" in text or "imed out" in text:
                raise TransferTimeout(f"data-parallel all-reduce did not complete within "
                                      f"{self.timeout_s:g}s: a rank is stalled") from None
            raise PeerError(f"data-parallel all-reduce failed (a rank died): {text}") from None
        return list(buffer.tolist())
