"""A backend's capabilities record: declared once, read by both sides; the class attributes
backends set before the record still work, with a DeprecationWarning."""

import pytest

from wtransfer import Capabilities, TrainerTransferEngine, WeightTransferEngine, get_backend


def test_each_shipped_backend_declares_one_record_for_both_sides():
    for name in ("ipc", "nccl", "ucx"):
        backend = get_backend(name)
        if backend.missing():
            continue  # (ucx without its wheels)
        assert backend.sender_class().capabilities is backend.receiver_class().capabilities


def test_a_receiver_setting_the_old_class_attributes_gets_them_in_its_record():
    with pytest.warns(DeprecationWarning, match=r"\['sender_check_s'\] as class attributes"):
        class OldReceiver(WeightTransferEngine):  # type: ignore[type-arg]
            sender_check_s = 0.5

    assert OldReceiver.capabilities == Capabilities(sender_check_s=0.5)
    assert WeightTransferEngine.capabilities == Capabilities()  # the base is untouched


def test_a_sender_setting_takes_pair_deltas_gets_pair_deltas():
    with pytest.warns(DeprecationWarning, match="takes_pair_deltas"):
        class OldSender(TrainerTransferEngine):  # type: ignore[type-arg]
            takes_pair_deltas = True

    assert OldSender.capabilities.pair_deltas is True

    class Subclass(OldSender):  # inherits the folded record, no second warning
        pass

    assert Subclass.capabilities.pair_deltas is True


def test_a_sender_overriding_the_old_stats_hook_still_reports_its_fields():
    with pytest.warns(DeprecationWarning, match="the hook is `_backend_stats` now"):
        class OldStats(TrainerTransferEngine):  # type: ignore[type-arg]
            def _moved(self):
                return {"sent_bytes": 7}

    assert OldStats._backend_stats(None) == {"sent_bytes": 7}  # type: ignore[arg-type]
    assert TrainerTransferEngine._backend_stats(None) == {}  # type: ignore[arg-type]
