"""Which update a receiver's weights are (their lineage), a strategy the receiver base holds:
the token of the update that landed last from a delta-enabled sender, and that sender's
header call, which opens a delta-enabled update (`wtransfer.delta`). `HoldsLineage` is its
public face on the receiver (`delta_base`, `forget_delta_base`)."""

from __future__ import annotations

from wtransfer.delta.codec import parsed_entries
from wtransfer.errors import DeltaBaseError, DeltaUnsupportedError, MetadataError
from wtransfer.manifest import Manifest
from wtransfer.receiver.deltas import piece_delta_refusal
from wtransfer.receiver.session import UpdateSession
from wtransfer.receiver.target import WeightTarget
from wtransfer.records import UpdateInfo


class Lineage:
    """The token of the update the weights are (`held`) and the open update's (`opening`)."""

    def __init__(self) -> None:
        self.held: str | None = None
        """The token of the last update that landed, from a delta-enabled sender: the base a
        delta must name (None after anything else changed the weights)."""
        self.opening: str | None = None
        """The open update's token (its `DeltaHeader`), held once it lands."""

    def start(self) -> None:
        """An update opened: it has no header yet."""
        self.opening = None

    @staticmethod
    def carries_header(info: UpdateInfo) -> bool:
        """Whether update call `info` is a delta-enabled sender's header call (no data)."""
        return info.delta is not None

    def open(self, info: UpdateInfo, session: UpdateSession, target: WeightTarget,
             last: Manifest | None) -> None:
        """A delta-enabled sender's header call: a delta is refused (`DeltaBaseError`, before
        anything is written) unless the weights are exactly its base; then the update's tensor
        list is the delta's (`wtransfer.receiver.deltas.DeltaTarget`). `last`: the tensor list
        the base came with (a delta by piece names the same one)."""
        header = info.delta
        assert header is not None  # (`carries_header`)
        if self.opening is not None:
            raise MetadataError("an update carries one delta header, before its tensors")
        if header.base is not None:
            if header.base != self.held:
                raise DeltaBaseError(
                    f"delta refused before any weight changed: it applies onto update "
                    f"{header.base[:12]}, this receiver holds "
                    f"{self.held[:12] if self.held else 'no known base'}")
            target.patching()  # (before anything looks at the target's views)
            if header.by_piece:
                refusal = ("no tensor list came before it" if last is None else
                           piece_delta_refusal(target, last.metas))
                if refusal is not None:
                    raise DeltaUnsupportedError(f"delta refused before any weight changed: "
                                                f"{refusal}; the sender sends in full")
                session.apply_piece_delta()
            else:
                session.apply_delta(parsed_entries(header))
        self.opening = header.token

    def landed(self) -> None:
        """The open update finished: the weights are its."""
        self.held = self.opening

    def forget(self) -> None:
        """The weights changed outside a delta-enabled update: no delta applies until a full
        update lands."""
        self.held = None


class HoldsLineage:
    """The public face of a receiver's `Lineage`."""

    lineage: Lineage

    @property
    def delta_base(self) -> str | None:
        """The token of the last update that landed, from a delta-enabled sender: the base a
        delta must name (None after anything else changed the weights)."""
        return self.lineage.held

    def forget_delta_base(self) -> None:
        """The weights changed outside a delta-enabled update (a failure, a rollback, a new
        sender): no delta applies until a full update lands."""
        self.lineage.forget()
