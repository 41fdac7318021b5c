"""`DeltaHeader`: what a delta-enabled update says about itself, in its first update call."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from wtransfer.delta.codec import DeltaEntry
from wtransfer.errors import MetadataError

_TOKEN = re.compile(r"[0-9a-f]{32}")


@dataclass(frozen=True, kw_only=True)
class DeltaHeader:
    """The identity of an update of a delta-enabled sender, and the base it builds on.

    Receivers that finish the update hold `token` as their base; `base` (None for a full
    update) is the token they must hold for the update to apply at all."""

    token: str
    """This update's identity (128 random bits, hex)."""
    base: str | None = None
    """The token of the update whose weights this delta applies onto; None: a full update."""
    entries: list[Any] = field(default_factory=list)
    """A delta's changed tensors (`DeltaEntry.to_wire` forms), in the order they travel."""
    by_piece: bool = False
    """An update of an M->N transfer: a delta's pair buckets carry their pieces' changed
    elements (`wtransfer.delta.pieces`; `entries` stays empty)."""

    def __post_init__(self) -> None:
        for token in (self.token, self.base):
            if token is not None and not (isinstance(token, str) and _TOKEN.fullmatch(token)):
                raise MetadataError(f"delta token must be 32 lowercase hex digits, got "
                                    f"{token!r:.80}")
        if (self.base is None or self.by_piece) and self.entries:
            raise MetadataError("a full update (no base), or a delta of an M->N transfer, "
                                "carries no delta entries")

    def parsed_entries(self) -> list[DeltaEntry]:
        """The entries, parsed (each name once)."""
        entries = [DeltaEntry.from_wire(item) for item in self.entries]
        if len({e.name for e in entries}) != len(entries):
            raise MetadataError("a delta names a tensor twice")
        return entries
