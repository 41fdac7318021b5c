"""A sender's side of a fleet of engines (`FleetClient`), held by the sender base: connecting
again when instances joined or left, sending an update once more to the survivors of a
drop-mode fleet, and naming the instances an update dropped."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace

from wtransfer.errors import LifecycleError, WTransferError
from wtransfer.protocol import FleetClient, WeightSyncClient
from wtransfer.records import TransferStats

log = logging.getLogger("wtransfer.trainer")


class FleetUpdates:
    """What a sender does around each update when its client is a fleet (a no-op for any
    other client)."""

    def __init__(self, client: WeightSyncClient | None, backend: str) -> None:
        self.fleet = client if isinstance(client, FleetClient) else None
        """The fleet, or None when the client is one engine (or none)."""
        self._backend = backend
        self._seen = (0, 0)
        """The fleet's (joined, generation) when the sender last connected."""

    def connected(self) -> None:
        """The sender connected: note the membership it reached."""
        if self.fleet is not None:
            self._seen = (self.fleet.joined, self.fleet.generation)

    def follow(self, *, fixed_receivers: bool, collective: bool,
               reconnect: Callable[[], None]) -> None:
        """Connect again (`reconnect`) when instances joined since the last connect (the
        transport must reach them), or left when the transport reaches exactly the receivers
        it was connected to (`fixed_receivers`); `LifecycleError` for trainer ranks sending
        together, which must all be created again."""
        fleet = self.fleet
        if fleet is None:
            return
        joined, generation = self._seen
        if fleet.joined == joined and (fleet.generation == generation or not fixed_receivers):
            return
        if collective:
            raise LifecycleError("the fleet's instances changed since these trainer ranks "
                                 "connected: create the senders again on every rank")
        log.info("%s: the fleet changed (instances joined or left): connecting again",
                 self._backend)
        reconnect()

    def send(self, send: Callable[[], TransferStats], *, collective: bool,
             reconnect: Callable[[], None]) -> TransferStats:
        """One update (`send`); in a drop-mode fleet, an update that failed on every instance
        (one died mid-broadcast) is sent again, once, to the instances that still answer."""
        try:
            return send()
        except WTransferError:
            fleet = self.fleet
            if fleet is None or fleet.on_failure != "drop" or collective or not fleet.prune():
                raise
            log.warning("%s: instances of the fleet stopped answering; sending the update "
                        "again to the others", self._backend)
            reconnect()
            return send()

    def report(self, stats: TransferStats, version: str | None) -> TransferStats:
        """`stats` naming the instances the fleet dropped during the update (logged with the
        update's `version`)."""
        fleet = self.fleet
        if fleet is None:
            return stats
        dropped = fleet.take_dropped()
        log.info(fleet.summary(version, dropped))
        return replace(stats, dropped=dropped) if fleet.on_failure == "drop" else stats
