"""`TensorListing`: which tensor list a sender's receivers hold, so that an update names an
unchanged list by its digest instead of sending it again (a trainer sends the same list every
step)."""

from __future__ import annotations

from typing import Any

from wtransfer.manifest import Manifest


class TensorListing:
    """The digest of the list the receivers got in this sender's last successful update that
    offered one (`held`), and the one the update in progress offers."""

    def __init__(self) -> None:
        self.held: str | None = None
        self._offered: str | None = None

    def fields(self, manifest: Manifest) -> dict[str, Any]:
        """The update fields that give the receivers `manifest`'s list: its digest where they
        hold it, else the list (which they hold once this update succeeds; until then a
        failed update sends it in full next time)."""
        held = self.held
        self.sent(manifest)
        return ({"tensors_digest": manifest.digest} if held == manifest.digest
                else {"tensors": manifest.wire})

    def sent(self, manifest: Manifest) -> None:
        """This update gives the receivers `manifest`'s list in full (they hold it once the
        update succeeds)."""
        self.held = None
        self._offered = manifest.digest

    def update_started(self) -> None:
        """An update begins: it has offered nothing yet."""
        self._offered = None

    def update_landed(self) -> None:
        """The update succeeded: the receivers hold the list it offered, if any."""
        if self._offered is not None:
            self.held = self._offered

    def forget(self) -> None:
        """The receivers are new (the sender connected again): they hold no list."""
        self.held = None
