"""Weight targets for backend tests."""

from __future__ import annotations

from typing import Any

import wtransfer
from wtransfer.launch.models import build
from wtransfer.shapes import randomize


class LoaderTarget(wtransfer.ModuleTarget):
    """A target that offers no storage of its own (as vLLM's loader does): every tensor lands
    in a temporary the receiver allocates, then goes through `load_weights`."""

    def direct_bytes(self, name: str) -> None:
        """Never the module's own storage."""
        return None


def assert_lands_in_loader_target(backend: str, info: Any, steps: int = 2) -> None:
    """Send a freshly randomized "mixed" model `steps` times with `info` into an in-process
    `backend` receiver whose target is a `LoaderTarget`; assert each update lands bit-exact."""
    source, held = build("mixed", seed=1, device="cpu"), build("mixed", seed=2, device="cpu")
    engine = wtransfer.create_receiver(backend, LoaderTarget(held))
    try:
        with wtransfer.trainer_init(info, client=wtransfer.LocalClient(engine),
                                    source=wtransfer.ModuleSource(source)) as sender:
            for step in range(steps):
                randomize(source, seed=7 + step)
                sender.send_weights()
                assert wtransfer.fingerprint(held.state_dict()) == \
                    wtransfer.fingerprint(source.state_dict()), f"update {step} differs"
    finally:
        engine.shutdown()
