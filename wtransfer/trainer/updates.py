"""What a sender's updates carry, a strategy the sender base holds: every update in full
(`FullUpdates`), or deltas against what the receivers hold (`DeltaUpdates`,
`TrainerInitInfo.delta`). `updates_for` picks one at connect; the base runs each `Payload`
the strategy hands it without knowing which it holds."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from wtransfer.errors import ConfigError, DeltaBaseError, DeltaUnsupportedError, SparseDeltaError
from wtransfer.records import Capabilities, DeltaHeader, TrainerInitInfo, TransferStats
from wtransfer.trainer.deltas import DeltaSender, DeltaUpdate, PairDeltaSender
from wtransfer.trainer.source import WeightSource
from wtransfer.wire import record_to_wire

Header = DeltaHeader
"""What an update strategy's header call carries (`Payload.header`, `Share.header`)."""


def _same(fields: dict[str, Any]) -> dict[str, Any]:
    return fields


@dataclass(frozen=True)
class Payload:
    """One update as the sender base sends it."""

    source: WeightSource
    """What the update sends (the trainer's source, or a delta's changed tensors)."""
    first_call: dict[str, Any] | None = None
    """An update call the lead issues right behind start, before the tensor list."""
    answer_first: bool = False
    """Whether every rank waits for the receivers' answer to `first_call` before any byte
    moves (a receiver that cannot take the update refuses it with nothing written)."""
    header: Header | None = None
    """A delta-enabled sender's header (`Share.header`, for the backends that encode)."""
    stats_fields: Callable[[dict[str, Any]], dict[str, Any]] = field(default=_same)
    """The update's `TransferStats` fields as the user reads them, from those of what moved."""


SendOne = Callable[[Payload], TransferStats]
"""The sender base's one update: send a payload, return what it measured."""


class Updates(Protocol):
    """What each update of a sender carries (`FullUpdates`, `DeltaUpdates`)."""

    @property
    def diff(self) -> DeltaSender | PairDeltaSender | None:
        """The delta state (the last-sent copy, the receivers' base); None without deltas."""

    def send(self, source: WeightSource, send_one: SendOne) -> TransferStats:
        """One update of `source` through `send_one` (once, or again after a refusal)."""

    def forget(self) -> None:
        """The receivers hold nothing known (they were initialized again): send in full."""


def sends_whole(updates: Updates, source: WeightSource) -> bool:
    """Whether every update of `source` sends it whole: full updates of a source that holds
    whole tensors (not adapters, whose updates name what they carry)."""
    return updates.diff is None and source.delta_ok


class HoldsUpdates:
    """The public face of a sender's update strategy, which the sender base holds."""

    updates: Updates

    @property
    def delta(self) -> DeltaSender | PairDeltaSender | None:
        """Delta updates (`TrainerInitInfo.delta`): the last-sent copy and the receivers'
        base (of each pair bucket this rank sends, when every rank sends its own shards);
        None without deltas."""
        return self.updates.diff


class FullUpdates:
    """Every update sends the whole source."""

    diff: None = None

    def send(self, source: WeightSource, send_one: SendOne) -> TransferStats:
        """The source, once."""
        return send_one(Payload(source))

    def forget(self) -> None:
        """Nothing is kept between updates."""


class DeltaUpdates:
    """A delta when the receivers hold its base, in full when they refuse it (before any byte
    landed) or hold none; the copy to diff against follows what landed."""

    def __init__(self, diff: DeltaSender | PairDeltaSender) -> None:
        self.diff = diff

    def send(self, source: WeightSource, send_one: SendOne) -> TransferStats:
        """One update of `source`: a delta, or in full after a refusal of its base."""
        diff = self.diff
        start = time.perf_counter()
        try:
            update = diff.prepare(source)
            try:
                stats = send_one(_payload(update, source))
            except DeltaBaseError as exc:
                if update.header.base is None:
                    raise
                if isinstance(exc, SparseDeltaError):
                    diff.sparse = False
                if isinstance(exc, DeltaUnsupportedError):
                    diff.disabled = str(exc)
                diff.forget()
                update = diff.prepare(source)
                stats = send_one(_payload(update, source))
            diff.landed(update)
        except BaseException:
            diff.forget()
            raise
        return replace(stats, seconds=time.perf_counter() - start,
                       delta_base_bytes=diff.copy_bytes)

    def forget(self) -> None:
        """The next update is full (and takes its copy again)."""
        self.diff.forget()


def _payload(update: DeltaUpdate, model: WeightSource) -> Payload:
    """`update` as the base sends it: its header call first (answered before any byte moves
    when it is a delta), its stats counting the model's bytes and the bytes that moved."""
    def stats_fields(fields: dict[str, Any]) -> dict[str, Any]:
        metas = model.metadata()
        return {**fields, "bytes": sum(m.nbytes for m in metas), "tensors": len(metas),
                "wire_bytes": fields["bytes"], "changed_fraction": update.changed_fraction}

    return Payload(update.source, first_call={"delta": record_to_wire(update.header)},
                   answer_first=update.header.base is not None, header=update.header,
                   stats_fields=stats_fields)


def first_updates(info: TrainerInitInfo) -> Updates:
    """The strategy a sender starts with: deltas of whole tensors when its init info asks for
    them (`TrainerInitInfo.delta`), else full updates."""
    return DeltaUpdates(DeltaSender(info.delta_copy_device)) if info.delta else FullUpdates()


def updates_for(now: Updates, info: TrainerInitInfo, *, backend: str, collective: bool,
                own_shards: bool, capabilities: Capabilities) -> Updates:
    """The strategy for how a sender sends, known once it connected: `now`, or deltas of each
    rank's own pair buckets where every rank sends its own shards (`own_shards`, on a backend
    that encodes them: `capabilities.pair_deltas`; `wtransfer.delta.pieces`); `ConfigError`
    where a delta cannot be taken."""
    if not info.delta or not (collective or own_shards):
        return now  # (each connect of a sender of own shards starts from a fresh one)
    if not own_shards:
        raise ConfigError("delta=True with a sharded source (or several trainer ranks) "
                          "needs an M->N transfer, where each rank diffs its own shards: "
                          "give every trainer rank a client, over nccl or ucx")
    if not capabilities.pair_deltas:
        raise ConfigError(f"delta=True: {backend} M->N shares each staged box "
                          "with every worker, where a delta saves nothing; set "
                          "delta=False, or send over nccl or ucx")
    return DeltaUpdates(PairDeltaSender(info.delta_copy_device))
