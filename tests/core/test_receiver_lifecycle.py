"""The receiver state machine: aborts, abandoned updates, re-init, version labels."""


import pytest
import torch
from wtransfer_ipc import IPCTrainerInitInfo

import wtransfer
from wtransfer.errors import LifecycleError, PeerError
from wtransfer.shapes import build_module, mixed_metas
from wtransfer.testing.conformance import wait_for


@pytest.fixture
def pair():
    metas = mixed_metas(layers=4)
    trainer, engine_model = build_module(metas, 1), build_module(metas, 2)
    engine = wtransfer.create_receiver("ipc", wtransfer.ModuleTarget(engine_model))
    client = wtransfer.LocalClient(engine)
    yield trainer, engine, client
    engine.shutdown()


def ipc_sender(trainer, client, **fields):
    return wtransfer.trainer_init(IPCTrainerInitInfo(**fields), client=client,
                                  source=wtransfer.ModuleSource(trainer))


def test_sender_side_failure_aborts_the_receiver_update_at_once(pair):
    trainer, engine, client = pair

    class Exploding(wtransfer.ModuleSource):
        def tensors(self):
            for i, item in enumerate(super().tensors()):
                if i == 30:
                    raise RuntimeError("trainer crashed while gathering")
                yield item

    sender = wtransfer.trainer_init(IPCTrainerInitInfo(bucket_bytes=4096), client=client,
                                    source=Exploding(trainer))
    with pytest.raises(RuntimeError, match="gathering"):
        sender.send_weights()
    assert engine.state == "failed"
    assert "sender aborted the update" in engine.failure and engine.torn
    sender.source = wtransfer.ModuleSource(trainer)
    sender.send_weights(weight_version="retry")
    assert engine.state == "ready" and client.weight_version == "retry"
    assert client.fingerprint() == wtransfer.fingerprint(trainer.state_dict())
    sender.shutdown()


def test_an_abandoned_update_fails_after_the_timeout(pair):
    trainer, engine, client = pair
    # 1 s: short enough to see the watchdog act, long enough that each call of the send
    # after it is answered in time on a loaded 2-core machine (0.2 s once was not)
    sender = ipc_sender(trainer, client, bucket_bytes=4096, timeout_s=1.0)
    engine.start_weight_update()
    with pytest.raises(LifecycleError, match="update is open"):
        engine.start_weight_update()
    wait_for(lambda: engine.state != "updating", 10, "the abandoned update to fail")
    assert engine.state == "failed" and "abandoned" in engine.failure
    sender.send_weights()
    assert engine.state == "ready"
    sender.shutdown()


def test_explicit_abort_message_becomes_peer_error(pair):
    trainer, engine, client = pair
    sender = ipc_sender(trainer, client)
    engine.start_weight_update()
    with pytest.raises(PeerError, match="sender aborted the update: out of memory"):
        engine.update_weights({"abort": "out of memory"})
    assert engine.state == "failed" and engine.torn is False
    sender.shutdown()


def test_reinit_replaces_staging_and_keeps_working(pair):
    trainer, engine, client = pair
    for bucket in (2048, 1 << 16):
        with ipc_sender(trainer, client, bucket_bytes=bucket) as sender:
            with torch.no_grad():
                for p in trainer.parameters():
                    p.add_(1)
            sender.send_weights()
            assert client.fingerprint() == wtransfer.fingerprint(trainer.state_dict())
    assert engine.last_update_bytes > 0


def test_send_after_shutdown_is_a_lifecycle_error(pair):
    trainer, _engine, client = pair
    sender = ipc_sender(trainer, client)
    sender.shutdown()
    with pytest.raises(LifecycleError, match="shut down"):
        sender.send_weights()


class Exploding(wtransfer.ModuleSource):
    """A trainer that crashes while gathering tensor #30 of every update."""

    def tensors(self):
        for i, item in enumerate(super().tensors()):
            if i == 30:
                raise RuntimeError("trainer crashed while gathering")
            yield item


@pytest.mark.parametrize(("bucket_bytes", "wrote"), [(4096, True), (1 << 20, False)])
def test_rollback_restores_every_overwritten_tensor_after_a_failed_update(bucket_bytes, wrote):
    metas = mixed_metas(layers=4)
    trainer, engine_model = build_module(metas, 1), build_module(metas, 2)
    engine = wtransfer.create_receiver("ipc", wtransfer.ModuleTarget(engine_model),
                                       rollback=True)
    client = wtransfer.LocalClient(engine)
    try:
        good = wtransfer.fingerprint(engine_model.state_dict())
        for _ in range(2):  # the rollback buffers are reused by the second failed update
            sender = wtransfer.trainer_init(IPCTrainerInitInfo(bucket_bytes=bucket_bytes),
                                            client=client, source=Exploding(trainer))
            with sender, pytest.raises(RuntimeError, match="gathering"):
                sender.send_weights()
            assert engine.state == "failed" and engine.torn is False
            assert ("rolled back" in engine.failure) is wrote  # big buckets: nothing written
            assert wtransfer.fingerprint(engine_model.state_dict()) == good
        with ipc_sender(trainer, client, bucket_bytes=bucket_bytes) as sender:
            sender.send_weights()
        assert client.fingerprint() == wtransfer.fingerprint(trainer.state_dict())
    finally:
        engine.shutdown()


def test_a_new_sender_supersedes_an_update_left_open(pair):
    trainer, engine, client = pair
    with ipc_sender(trainer, client, bucket_bytes=4096):  # a trainer that dies mid-update
        engine.start_weight_update()
    with ipc_sender(trainer, client, bucket_bytes=4096) as sender:
        sender.send_weights(weight_version="fresh")
    assert engine.state == "ready" and client.weight_version == "fresh"
    assert client.fingerprint() == wtransfer.fingerprint(trainer.state_dict())


def test_a_finish_from_a_sender_replaced_mid_update_is_refused_as_replaced(pair):
    """Sender A's update calls landed, then sender B initialized the receiver (failing A's
    open update), then A's finish arrives: A is told it was replaced (`SenderReplacedError`),
    not to call start_weight_update; B's update lands."""
    from wtransfer.errors import SenderReplacedError

    trainer, engine, client = pair
    engine_a = engine
    old = ipc_sender(trainer, client, bucket_bytes=4096)
    finish = client.finish_weight_update

    def replaced_before_the_finish(weight_version=None):
        ipc_sender(trainer, client, bucket_bytes=4096)  # B's init lands first
        finish(weight_version)

    client.finish_weight_update = replaced_before_the_finish
    with pytest.raises(SenderReplacedError, match="replaced by a newer trainer_init"):
        old.send_weights(weight_version="old")
    del client.finish_weight_update
    assert engine_a.state == "failed" and client.weight_version != "old"
