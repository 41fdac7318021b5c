"""Sharded trainers (FSDP2 over gloo, real processes): every rank sends together, full tensors
are gathered bucket by bucket, and several ranks can send at once."""

import os
import signal

import pytest

import wtransfer
from wtransfer.control.rpc import RPCClient
from wtransfer.launch.models import build
from wtransfer.launch.processes import spawn_receiver
from wtransfer.launch.trainer_ranks import TrainerRanks
from wtransfer.testing.conformance import wait_for

BUCKET = 64 << 10
"""Smaller than the largest tensors (the 512 KiB embedding, split over 8 buckets)."""


def init_fields(backend, senders, workers, **extra):
    fields = {"bucket_bytes": BUCKET, "timeout_s": 20.0, "m2n": False, **extra}  # the
    # gathering path (M->N has tests of its own: test_m2n_transfers.py)
    if backend == "nccl":  # a direct threshold the 512 KiB embedding passes: a sharded source
        fields.update(master_address="127.0.0.1", world_size=senders + workers,  # must not use it
                      direct_threshold=32 << 10)
    return fields


def check_landed(trainers, ranks, receivers, updates=1):
    """Every rank sent; the receivers hold the full model's last weights; the gather bound
    held."""
    outs = [trainers.wait_for(r, "sent", 180, count=updates) for r in range(ranks)]
    assert trainers.wait(60) == [0] * ranks, [trainers.stderr(r)[-2000:] for r in range(ranks)]
    full = outs[0]["fingerprint"]
    assert all(o["fingerprint"] == full for o in outs)
    for receiver in receivers:
        client = RPCClient(receiver.address, timeout_s=30)
        assert client.fingerprint() == full
        client.close()
    for out in outs:  # no rank ever held more than num_buffers x bucket_bytes of gathered bytes
        assert out["gathered_peak_bytes"] <= 2 * BUCKET
    return outs


@pytest.mark.parametrize(("ranks", "model"), [  # 4 ranks: the same gathers, wider
    (2, "llm:tiny"), pytest.param(4, "mixed", marks=pytest.mark.extended)])
def test_fsdp_ranks_send_one_model_gathered_bucket_by_bucket(ranks, model):
    with spawn_receiver("ipc", model=model, seed=2) as receiver, \
            TrainerRanks(ranks, backend="ipc", addresses=[receiver.address], model=model,
                         init_fields=init_fields("ipc", 1, 1), fingerprint=True) as trainers:
        outs = check_landed(trainers, ranks, [receiver])
        assert outs[0]["gathered_peak_bytes"] > 0  # the sender gathered
        assert all(o["gathered_peak_bytes"] == 0 for o in outs[1:])  # the others only sent rows


@pytest.mark.parametrize(("backend", "receivers"), [("ipc", 2), ("nccl", 1)])
def test_two_senders_share_the_plan_into_every_receiver(backend, receivers):
    children = [spawn_receiver(backend, model="mixed", seed=2 + i) for i in range(receivers)]
    try:
        with TrainerRanks(2, backend=backend, addresses=[c.address for c in children],
                          senders=2, updates=2, fingerprint=True,
                          init_fields=init_fields(backend, 2, receivers)) as trainers:
            outs = check_landed(trainers, 2, children, updates=2)
            assert all(o["gathered_peak_bytes"] > 0 for o in outs)  # both gathered and sent
    finally:
        for child in children:
            child.close()


def test_a_sender_killed_mid_update_fails_every_side_and_the_next_update_lands():
    with spawn_receiver("nccl", model="mixed", seed=2, rollback=True) as receiver:
        client = RPCClient(receiver.address, timeout_s=30)
        before = client.fingerprint()
        fields = init_fields("nccl", 2, 1, timeout_s=5.0)
        with TrainerRanks(2, backend="nccl", addresses=[receiver.address], senders=2,
                          updates=1000, init_fields=fields, timeout_s=10.0) as trainers:
            trainers.wait_for(1, "ready", 120)
            os.kill(trainers.procs[1].pid, signal.SIGKILL)  # a sender dies mid-transfer
            codes = trainers.wait(60)
            assert codes[0] != 0  # the surviving rank failed, within its deadlines
            assert "Traceback" in trainers.stderr(0)
        wait_for(lambda: client.status()["state"] != "updating", 30,
                 "the receiver to fail the update at its deadline")
        status = client.status()
        assert status["state"] in ("failed", "ready") and status["torn"] is False
        if status["state"] == "failed":  # killed mid-update: rolled back to the last weights,
            # or told by the surviving rank before any weight changed, or timed out
            assert any(why in status["failure"] for why in (
                "rolled back", "sender aborted", "abandoned")), status["failure"]
        # a fresh pair of trainer ranks lands a full update
        fields = init_fields("nccl", 2, 1)
        with TrainerRanks(2, backend="nccl", addresses=[receiver.address], senders=2,
                          seed=9, init_fields=fields, fingerprint=True) as trainers:
            outs = check_landed(trainers, 2, [receiver])
        assert outs[0]["fingerprint"] != before
        client.close()


def test_a_single_process_trainer_still_needs_no_process_group():
    with spawn_receiver("ipc", model="mixed", seed=2) as receiver:
        model = build("mixed", 1, "cpu")
        client = RPCClient(receiver.address, timeout_s=30)
        from wtransfer_ipc import IPCTrainerInitInfo

        with wtransfer.trainer_init(IPCTrainerInitInfo(bucket_bytes=BUCKET), client=client,
                                    source=wtransfer.ModuleSource(model)) as sender:
            stats = sender.send_weights()
        assert stats.gathered_peak_bytes == 0
        assert client.fingerprint() == wtransfer.fingerprint(model.state_dict())


@pytest.mark.parametrize("backend, differ", [("ipc", {"bucket_bytes": BUCKET * 2}),
                                             ("nccl", {"m2n": True})])
def test_ranks_that_disagree_on_their_init_info_all_get_one_message_naming_the_field(
        backend, differ):
    """Two sending ranks whose init infos differ (one rank's bucket size, or M->N asked on
    one rank only): every rank fails at connect with the same error, naming the field and
    each rank's value, and the receiver is left as it was."""
    field = next(iter(differ))
    with spawn_receiver(backend, model="mixed", seed=2) as receiver:
        client = RPCClient(receiver.address, timeout_s=30)
        before = client.fingerprint()
        fields = [init_fields(backend, 2, 1), {**init_fields(backend, 2, 1), **differ}]
        with TrainerRanks(2, backend=backend, addresses=[receiver.address], senders=2,
                          init_fields=fields, timeout_s=20.0) as trainers:
            codes = trainers.wait(120)
            errors = [trainers.stderr(r).strip().splitlines()[-1].split("]: ", 1)[-1]
                      for r in range(2)]  # (torch prefixes "[rankN]: ")
        assert codes[0] != 0 and codes[1] != 0
        assert errors[0] == errors[1], errors
        assert f"differ in ['{field}']" in errors[0]
        assert f"{field}: [{fields[0][field]!r}, {differ[field]!r}]".replace("'", "") in \
            errors[0].replace("'", "")
        assert client.fingerprint() == before
        client.close()
