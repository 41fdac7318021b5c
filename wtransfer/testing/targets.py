"""Weight targets for backend tests."""

from __future__ import annotations

import wtransfer


class LoaderTarget(wtransfer.ModuleTarget):
    """A target that offers no storage of its own (as vLLM's loader does): every tensor lands
    in a temporary the receiver allocates, then goes through `load_weights`."""

    def direct_bytes(self, name: str) -> None:
        """Never the module's own storage."""
        return None
