"""The shipped conformance suite, run on the ipc backend (POSIX shared memory on CPU)."""

import pytest
import torch
from wtransfer_ipc import IPCTrainerInitInfo

import wtransfer
from wtransfer.errors import ConfigError, MetadataError
from wtransfer.launch.models import build
from wtransfer.manifest import Manifest
from wtransfer.packing import BucketPlan, metas_to_wire
from wtransfer.records import DEFAULT_BUCKET_BYTES
from wtransfer.testing.conformance import BackendConformance
from wtransfer.wire import digest


class TestIPCConformance(BackendConformance):
    backend = "ipc"


def each_refused(engine, cases, unchanged):
    """Each (update info, error type, message) of `cases` refused in an update of its own,
    which then fails, with `unchanged()` true after each."""
    for update, error, message in cases:
        engine.start_weight_update()
        with pytest.raises(error, match=message):
            engine.update_weights(update)
        assert engine.state == "failed"
        assert unchanged()


def test_a_zero_copy_update_may_name_the_last_tensor_list_by_digest_and_nothing_else():
    """A zero-copy update names an unchanged tensor list by its digest. On CPU the receiver
    accepts a digest of the list it got last (and then refuses zero-copy itself: that needs
    CUDA), and refuses any other digest, a digest outside zero-copy, or a list and a digest
    together, each before any weight changes."""
    source, held = build("mixed", seed=1, device="cpu"), build("mixed", seed=2, device="cpu")
    listed = metas_to_wire(wtransfer.ModuleSource(source).metadata())
    engine = wtransfer.create_receiver("ipc", wtransfer.ModuleTarget(held))
    with wtransfer.trainer_init(IPCTrainerInitInfo(bucket_bytes=1 << 20),
                                client=wtransfer.LocalClient(engine),
                                source=wtransfer.ModuleSource(source)) as sender:
        sender.send_weights()  # packed: the first bucket carries the whole list
        landed = wtransfer.fingerprint(held.state_dict())
        zero_copy = {"storages": [], "used": b"", "layout": b"", "event": b"", "token": "t",
                     "sender_pid": 1}
        cases = [
            ({"tensors_digest": digest(listed), "zero_copy": zero_copy}, ConfigError,
             "zero-copy update shares CUDA memory"),
            ({"tensors_digest": "0" * 32, "zero_copy": zero_copy}, MetadataError,
             "does not name the tensor list this receiver got last"),
            ({"tensors_digest": digest(listed)}, MetadataError,
             "only a zero-copy update may name its tensor list by digest"),
            ({"tensors": listed, "tensors_digest": digest(listed)}, MetadataError,
             "'tensors' or 'tensors_digest', not both"),
        ]
        each_refused(engine, cases, lambda: wtransfer.fingerprint(held.state_dict()) == landed)
        manifest = Manifest(wtransfer.ModuleSource(source).metadata())
        assert (manifest.wire, manifest.digest) == (listed, digest(listed))  # what it names
    engine.shutdown()


@pytest.mark.parametrize("m2n", [False, True])
def test_an_m2n_update_read_in_place_is_refused_where_it_cannot_apply(m2n):
    """`in_place_ranks` (M->N read out of the ranks' shards) is refused in a transfer that is
    not M->N, beside a bucket of staging, and on a receiver without CUDA, each naming why
    and before any weight changes."""
    source, held = build("mixed", seed=1, device="cpu"), build("mixed", seed=2, device="cpu")
    listed = metas_to_wire(wtransfer.ModuleSource(source).metadata())
    engine = wtransfer.create_receiver("ipc", wtransfer.ModuleTarget(held))
    before = wtransfer.fingerprint(held.state_dict())
    rank = {"zero_copy": {"storages": [], "used": b"", "layout": b"", "event": b"",
                          "token": "t", "sender_pid": 1}, "pieces": []}
    with wtransfer.trainer_init(IPCTrainerInitInfo(bucket_bytes=1 << 20, m2n=m2n),
                                client=wtransfer.LocalClient(engine),
                                source=wtransfer.ModuleSource(source)):
        cases = [({"tensors": listed, "in_place_ranks": [rank], "pieces": [[0, [0], [1], 0, 4]]},
                  MetadataError, "a whole M->N update on its own")]
        cases.append(({"tensors": listed, "in_place_ranks": [rank]}, ConfigError,
                      "shares CUDA memory") if m2n else
                     ({"tensors": listed, "in_place_ranks": [rank]}, MetadataError,
                      "this transfer is not M->N"))
        each_refused(engine, cases, lambda: wtransfer.fingerprint(held.state_dict()) == before)
    engine.shutdown()


def test_an_event_on_shared_memory_staging_is_refused_before_any_write():
    """`event` orders reads of CUDA staging; on a shared-memory sender it is a malformed
    update, named as such, and no weight changes."""
    source, held = build("mixed", seed=1, device="cpu"), build("mixed", seed=2, device="cpu")
    engine = wtransfer.create_receiver("ipc", wtransfer.ModuleTarget(held))
    before = wtransfer.fingerprint(held.state_dict())
    plan = BucketPlan.build(wtransfer.ModuleSource(source).metadata(), 1 << 20)
    bucket = plan.buckets[0]
    with wtransfer.trainer_init(IPCTrainerInitInfo(bucket_bytes=1 << 20),
                                client=wtransfer.LocalClient(engine),
                                source=wtransfer.ModuleSource(source)):
        engine.start_weight_update()
        with pytest.raises(MetadataError, match="'event' orders reads of CUDA staging"):
            engine.update_weights({"tensors": metas_to_wire(plan.metas), "buffer": 0,
                                   "nbytes": bucket.nbytes, "event": b"\0" * 64,
                                   "slices": [s.to_wire() for s in bucket.slices]})
        assert engine.state == "failed"
    assert wtransfer.fingerprint(held.state_dict()) == before
    assert engine.torn is False
    engine.shutdown()


def test_an_engine_tensor_resized_between_updates_is_refused_although_checked_at_start():
    """The receiver checks its last tensor list against the engine when an update opens, so a
    repeated list starts moving at once. An engine parameter resized since the last update
    fails that early check; the update is then refused when the list is announced, naming
    the tensor, before any weight changes."""
    source, held = build("mixed", seed=1, device="cpu"), build("mixed", seed=2, device="cpu")
    engine = wtransfer.create_receiver("ipc", wtransfer.ModuleTarget(held))
    client = wtransfer.LocalClient(engine)
    with wtransfer.trainer_init(IPCTrainerInitInfo(bucket_bytes=1 << 20), client=client,
                                source=wtransfer.ModuleSource(source)) as sender:
        sender.send_weights("v1")
        sender.send_weights("v2")  # the same list: checked when the update opened
        assert wtransfer.fingerprint(held.state_dict()) == wtransfer.fingerprint(
            source.state_dict())
        name, param = next(iter(held.named_parameters()))
        param.data = torch.zeros(param.shape[0] + 1, *param.shape[1:], dtype=param.dtype)
        before = wtransfer.fingerprint(held.state_dict())
        with pytest.raises(MetadataError, match=rf"'{name}': sent .* engine holds"):
            sender.send_weights("v3")
    assert wtransfer.fingerprint(held.state_dict()) == before
    assert engine.torn is False
    assert client.weight_version == "v2"
    engine.shutdown()


def test_free_events_that_do_not_fit_the_receiver_are_refused_at_init():
    """`free_events` (CUDA staging: the events a worker records after reading a slot) are
    refused at init, naming the mismatch, when the staging is shared memory or the list has
    no entry for this worker; the receiver then takes a proper sender."""
    source, held = build("mixed", seed=1, device="cpu"), build("mixed", seed=2, device="cpu")
    engine = wtransfer.create_receiver("ipc", wtransfer.ModuleTarget(held), worker_index=1)
    base = {"bucket_bytes": 1 << 20, "num_buffers": 2, "sender_pid": 1, "token": "t",
            "buffers": ["wt-none-0", "wt-none-1"]}
    cases = [
        ({**base, "transport": "shm", "free_events": [[b"a", b"b"], [b"c", b"d"]]},
         "free_events order the staging reads of one sender's CUDA buffers; this init info "
         "has shared memory"),
        ({**base, "transport": "cuda", "free_events": [[b"a", b"b"]]},
         r"free_events lists 1 worker\(s\); this receiver is worker 1"),
        ({**base, "transport": "cuda", "free_events": [[b"a", b"b"], [b"c"]]},
         r"free_events\[1\] must list 2 event handles"),
    ]
    for init, message in cases:
        with pytest.raises(ConfigError, match=message):
            engine.init_transfer_engine(init)
        assert engine.state == "new"
    with wtransfer.trainer_init(IPCTrainerInitInfo(bucket_bytes=1 << 20),
                                client=wtransfer.LocalClient(engine),
                                source=wtransfer.ModuleSource(source)) as sender:
        sender.send_weights()
    assert wtransfer.fingerprint(held.state_dict()) == wtransfer.fingerprint(source.state_dict())
    engine.shutdown()


def test_a_sender_without_a_bucket_size_takes_the_default_and_tells_the_receivers():
    """`bucket_bytes=None` (the default) becomes `DEFAULT_BUCKET_BYTES` for shared-memory
    staging, and the receivers are told that size; an explicit size is kept."""
    source, held = build("mixed", seed=1, device="cpu"), build("mixed", seed=2, device="cpu")
    assert IPCTrainerInitInfo().bucket_bytes is None
    engine = wtransfer.create_receiver("ipc", wtransfer.ModuleTarget(held))
    with wtransfer.trainer_init(IPCTrainerInitInfo(), client=wtransfer.LocalClient(engine),
                                source=wtransfer.ModuleSource(source)) as sender:
        sender.send_weights()
        assert sender.bucket_bytes == DEFAULT_BUCKET_BYTES
        assert engine.init_info is not None
        assert engine.init_info.bucket_bytes == DEFAULT_BUCKET_BYTES
    assert wtransfer.fingerprint(held.state_dict()) == wtransfer.fingerprint(source.state_dict())
    with wtransfer.trainer_init(IPCTrainerInitInfo(bucket_bytes=1 << 20),
                                client=wtransfer.LocalClient(engine),
                                source=wtransfer.ModuleSource(source)) as sender:
        assert sender.bucket_bytes == 1 << 20
        assert engine.init_info is not None and engine.init_info.bucket_bytes == 1 << 20
    engine.shutdown()
