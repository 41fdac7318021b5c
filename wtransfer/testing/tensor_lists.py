"""Backend tests of how an update names its tensor list: in full, or by the digest of the
list the receivers got last."""

from __future__ import annotations

from typing import Any

import pytest

import wtransfer
from wtransfer.control.rpc import RPCCall, RPCClient
from wtransfer.errors import MetadataError
from wtransfer.launch.models import build
from wtransfer.launch.processes import spawn_receiver
from wtransfer.records import TransferStats
from wtransfer.shapes import randomize


class RecordingClient(RPCClient):
    """An `RPCClient` that remembers which fields each update call carried."""

    def __init__(self, address: str, **kwargs: Any) -> None:
        super().__init__(address, **kwargs)
        self.sent: list[list[str]] = []

    def submit(self, method: str, **args: Any) -> RPCCall:
        """Record the update's field names, then send as usual."""
        if method == "update_weights":
            self.sent.append(sorted(args["update_info"]))
        return super().submit(method, **args)


def assert_the_list_travels_once(backend: str, info: Any, steps: int = 3
                                 ) -> tuple[list[list[str]], TransferStats]:
    """Send a freshly randomized "mixed" model `steps` times to a `backend` receiver process;
    assert each lands bit-exact and that only the first update carried the tensor list (the
    others its digest). Returns the field names of every update call, and the last send's
    statistics."""
    model = build("mixed", seed=1, device="cpu")
    with spawn_receiver(backend, model="mixed", seed=2) as receiver:
        client = RecordingClient(receiver.address, timeout_s=60)
        try:
            with wtransfer.trainer_init(info, client=client,
                                        source=wtransfer.ModuleSource(model)) as sender:
                for step in range(steps):
                    randomize(model, seed=100 + step)
                    stats = sender.send_weights()
                    assert client.fingerprint() == wtransfer.fingerprint(model.state_dict())
            listed = ["tensors" in fields for fields in client.sent]
            named = ["tensors_digest" in fields for fields in client.sent]
            assert listed[0] and not named[0], client.sent
            assert not any(listed[1:]) and all(named[1:]), client.sent
            return client.sent, stats
        finally:
            client.close()


def assert_an_unknown_list_is_refused(backend: str, info: Any) -> None:
    """An update naming a digest the receiver does not hold, or carrying a list and a digest,
    fails before any weight changes, saying what to send instead."""
    model = build("mixed", seed=1, device="cpu")
    with spawn_receiver(backend, model="mixed", seed=2) as receiver:
        client = RPCClient(receiver.address, timeout_s=60)
        try:
            with wtransfer.trainer_init(info, client=client,
                                        source=wtransfer.ModuleSource(model)):
                before = client.fingerprint()
                client.start_weight_update()  # no update yet under this init: no list to name
                with pytest.raises(MetadataError, match=r"tensors_digest '0+' does not name "
                                                        r"the tensor list.*must send 'tensors'"):
                    client.update_weights({"tensors_digest": "0" * 32})
                assert client.status()["state"] == "failed"
                assert client.fingerprint() == before
                client.start_weight_update()
                with pytest.raises(MetadataError,
                                   match="'tensors' or 'tensors_digest', not both"):
                    client.update_weights({"tensors": [], "tensors_digest": "0" * 32})
                assert client.fingerprint() == before
        finally:
            client.close()
