"""The trainer ranks that send one update together (sharded trainers, several senders).

Every rank of the trainer's process group calls `trainer_init` and `send_weights`; ranks with a
client are senders. `TrainerGroup` is their coordination: a gloo group of the same ranks with
the transfer's deadline (so a rank that died fails the others in time instead of holding them),
msgpack payloads exchanged as byte tensors (no pickle), and an all-ranks verdict after each
step so every rank stops the same way when one failed.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from wtransfer import wire
from wtransfer.errors import (
    ConfigError,
    PeerError,
    TransferTimeout,
    error_kind,
    remote_error,
)
from wtransfer.packing import gather_records

T = TypeVar("T")


def _collective_error(what: str, exc: RuntimeError, timeout_s: float) -> Exception:
    text = str(exc)
    if "imeout" in text or "imed out" in text:
        return TransferTimeout(f"trainer ranks did not {what} within {timeout_s:g}s "
                               f"(a rank died or stalled): {text[:300]}")
    return PeerError(f"trainer ranks could not {what} (a rank died?): {text[:300]}")


class TrainerGroup:
    """The trainer ranks of `process_group` (default: the default group) sending together."""

    def __init__(self, process_group: Any, *, has_client: bool, timeout_s: float,
                 senders: int | None = None) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise ConfigError("a sharded source, client=None or process_group= means every "
                              "trainer rank sends together: initialize torch.distributed first")
        self.timeout_s = timeout_s
        ranks = dist.get_process_group_ranks(process_group or dist.group.WORLD)
        self.ranks = sorted(ranks)
        self.rank = dist.get_rank()
        self.size = len(self.ranks)
        self.pg = dist.new_group(self.ranks, backend="gloo",
                                 timeout=timedelta(seconds=timeout_s),
                                 use_local_synchronization=True)
        flags = self.all_gather_ints([int(has_client)])
        self.senders = [r for r, (flag,) in zip(self.ranks, flags, strict=True) if flag]
        if not self.senders:
            raise ConfigError("no trainer rank has a client: give at least one rank a client")
        if senders is not None and senders != len(self.senders):
            raise ConfigError(f"senders={senders}, but {len(self.senders)} trainer rank(s) "
                              "have a client; give exactly that many ranks a client")
        self.sender_index = self.senders.index(self.rank) if has_client else None

    @property
    def lead(self) -> bool:
        """The first sender drives the control plane (start, announce, finish)."""
        return self.sender_index == 0

    def all_gather_ints(self, values: list[int]) -> list[list[int]]:
        """Every rank's `values` (same length everywhere), in rank order."""
        mine = torch.tensor(values, dtype=torch.int64)
        out = [torch.empty_like(mine) for _ in range(self.size)]
        try:
            dist.all_gather(out, mine, group=self.pg)
        except RuntimeError as exc:
            raise _collective_error("exchange their state", exc, self.timeout_s) from None
        return [t.tolist() for t in out]

    def all_gather_records(self, record: Any) -> list[Any]:
        """Every rank's plain-data `record`, in rank order (`packing.gather_records`)."""
        return gather_records(record, self._all_gather)

    def _all_gather(self, mine: torch.Tensor) -> list[torch.Tensor]:
        out = [torch.empty_like(mine) for _ in range(self.size)]
        try:
            dist.all_gather(out, mine, group=self.pg)
        except RuntimeError as exc:
            raise _collective_error("exchange their records", exc, self.timeout_s) from None
        return out

    def verdict(self, error: BaseException | None) -> None:
        """Every rank says whether its part succeeded; raise the first failure on every rank
        (each rank learns why the others stopped)."""
        reports = self.all_gather_records(
            None if error is None else [error_kind(error),
                                        f"{type(error).__name__}: {error}"[:2000]])
        failed = [(r, report) for r, report in zip(self.ranks, reports, strict=True) if report]
        if error is not None:
            raise error
        if failed:
            rank, (kind, text) = failed[0]  # the same kind on every rank (a refused delta
            raise remote_error(f"trainer rank {rank} failed: {text}", str(kind))  # is one)

    def close(self) -> None:
        """Release the coordination group."""
        dist.destroy_process_group(self.pg)


class Ranks:
    """This rank's place among the trainer ranks that send one update: alone (no group), or
    one rank of a `TrainerGroup`. Every step of an update runs through `together`, so all
    ranks fail the same way when one fails."""

    def __init__(self, group: TrainerGroup | None) -> None:
        self.group = group

    @property
    def sender_index(self) -> int | None:
        """This rank's index among the senders (None: it only helps gather)."""
        return self.group.sender_index if self.group is not None else 0

    @property
    def senders(self) -> int:
        """How many trainer ranks send."""
        return len(self.group.senders) if self.group is not None else 1

    @property
    def lead(self) -> bool:
        """Whether this rank drives the control plane (start, tensor list, finish)."""
        return self.sender_index == 0

    def together(self, step: Callable[[], T]) -> T | None:
        """Run `step` here, then agree with the other ranks: every rank raises the first
        failure of any rank (alone: just run it)."""
        result, error = None, None
        try:
            result = step()
        except BaseException as exc:
            error = exc
        if self.group is not None:
            self.group.verdict(error)
        elif error is not None:
            raise error
        return result

    def gather(self, record: Any) -> list[Any]:
        """Every rank's plain-data `record`, in rank order (alone: `[record]`)."""
        return [record] if self.group is None else self.group.all_gather_records(record)

    def close(self) -> None:
        """Release the coordination group, if any."""
        if self.group is not None:
            self.group.close()


def broadcast_record(record: Any, src: int = 0, group: Any = None) -> Any:
    """Rank `src`'s plain-data `record` on every rank of `group` (msgpack through a byte
    tensor, so nothing is pickled); the other ranks pass None."""
    mine = dist.get_rank() == src
    data = wire.encode(record) if mine else b""
    size = torch.tensor([len(data)], dtype=torch.int64)
    dist.broadcast(size, src, group=group)
    buffer = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if mine
              else torch.empty(int(size.item()), dtype=torch.uint8))
    dist.broadcast(buffer, src, group=group)
    return wire.decode(buffer.numpy().tobytes())
