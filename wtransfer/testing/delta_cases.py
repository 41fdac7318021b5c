"""Conformance cases of delta updates (`wtransfer.delta`), part of `BackendConformance`:
every backend carries deltas, since a delta is an ordinary update of a different list."""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

import pytest

from wtransfer.fingerprint import fingerprint
from wtransfer.shapes import perturb, randomize
from wtransfer.trainer.source import WeightSource


class _FailingSource(WeightSource):
    """A source whose walk fails halfway (a trainer crashing mid-update)."""

    def __init__(self, inner: WeightSource) -> None:
        self.inner = inner

    def metadata(self) -> Any:
        return self.inner.metadata()

    def tensors(self) -> Any:
        for index, item in enumerate(self.inner.tensors()):
            if index == 40:
                raise RuntimeError("the trainer failed mid-update")
            yield item


class DeltaCases:
    """Delta cases; the hooks (`receivers`, `client`, `sender`, ...) are `BackendConformance`'s."""

    def test_thirty_delta_updates_stay_bit_exact_and_move_only_the_changes(
            self, procs: ExitStack) -> None:
        """After a full first update, 30 updates of ~1% changed elements (every dtype, one
        tensor split over buckets) each land bit-exact, move less than a tenth of the model's
        bytes, and the sender's last-sent copy stays one model's size; a step that changes
        every element still lands (sent dense)."""
        model = self.trainer_model(seed=3)  # type: ignore[attr-defined]
        client = self.client(self.receivers(procs))  # type: ignore[attr-defined]
        model_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        with self.sender(model, client, delta=True) as sender:  # type: ignore[attr-defined]
            first = sender.send_weights(weight_version="full")
            assert first.wire_bytes == first.bytes == model_bytes
            assert first.changed_fraction is None
            for step in range(30):
                if step == 17:
                    randomize(model, seed=500)
                else:
                    perturb(model, 0.01, seed=step)
                stats = sender.send_weights(weight_version=f"d{step}")
                assert stats.bytes == model_bytes
                assert stats.delta_base_bytes == model_bytes
                if step == 17:
                    assert stats.changed_fraction is not None and stats.changed_fraction > 0.9
                else:
                    assert stats.wire_bytes is not None and stats.wire_bytes < model_bytes / 10
                    assert stats.changed_fraction is not None
                    assert 0.005 < stats.changed_fraction < 0.02
                if step % 10 == 9 or step == 17:
                    assert client.fingerprint() == fingerprint(model.state_dict()), step
            assert client.fingerprint() == fingerprint(model.state_dict())

    def test_a_delta_on_a_base_the_receiver_does_not_hold_is_refused_and_sent_in_full(
            self, procs: ExitStack) -> None:
        """A sender whose idea of the receivers' base is wrong: the receiver refuses the delta
        before writing anything and the sender sends the update in full by itself; a failed
        update (the trainer fails mid-walk) also makes the next update full; deltas after it
        land."""
        model = self.trainer_model(seed=4)  # type: ignore[attr-defined]
        client = self.client(self.receivers(procs))  # type: ignore[attr-defined]
        with self.sender(model, client, delta=True) as sender:  # type: ignore[attr-defined]
            full = sender.send_weights()
            sender.delta.base = "0" * 32  # not what the receiver holds
            perturb(model, 0.01, seed=1)
            again = sender.send_weights()
            assert again.wire_bytes == full.bytes  # sent in full after the refusal
            assert client.fingerprint() == fingerprint(model.state_dict())
            perturb(model, 0.01, seed=2)
            assert sender.send_weights().wire_bytes < full.bytes / 10
            perturb(model, 0.01, seed=3)
            own = sender.source
            sender.source = _FailingSource(own)
            try:
                with pytest.raises(RuntimeError, match="failed mid-update"):
                    sender.send_weights()
            finally:
                sender.source = own
            assert sender.delta.base is None
            after = sender.send_weights(weight_version="after-failure")
            assert after.wire_bytes == full.bytes
            assert client.fingerprint() == fingerprint(model.state_dict())
            perturb(model, 0.01, seed=4)
            assert sender.send_weights().wire_bytes < full.bytes / 10
            assert client.fingerprint() == fingerprint(model.state_dict())

    def test_a_new_sender_starts_in_full_and_its_deltas_land(self, procs: ExitStack) -> None:
        """A second trainer (a restart) holds no base: its first update is full, the deltas
        after it land bit-exact; the first one is refused as replaced."""
        model = self.trainer_model(seed=6)  # type: ignore[attr-defined]
        client = self.client(self.receivers(procs))  # type: ignore[attr-defined]
        first = self.sender(model, client, delta=True)  # type: ignore[attr-defined]
        first.send_weights()
        perturb(model, 0.01, seed=9)
        second = self.sender(model, client, delta=True)  # type: ignore[attr-defined]
        try:
            stats = second.send_weights()
            assert stats.wire_bytes == stats.bytes
            perturb(model, 0.01, seed=10)
            stats = second.send_weights()
            assert stats.wire_bytes is not None and stats.wire_bytes < stats.bytes / 10
            assert client.fingerprint() == fingerprint(model.state_dict())
        finally:
            second.shutdown()
            first.shutdown()

