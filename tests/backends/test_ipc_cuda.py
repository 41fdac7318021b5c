"""The CUDA path of the ipc backend: CUDA IPC handles between processes on one GPU."""

from array import array

import pytest
import torch
from wtransfer_ipc import IPCTrainerInitInfo

import wtransfer
from wtransfer.control.rpc import RPCClient
from wtransfer.launch.models import build
from wtransfer.launch.processes import spawn_receiver
from wtransfer.shapes import build_module, mixed_metas
from wtransfer.testing.conformance import BackendConformance


@pytest.mark.gpu
class TestIPCConformanceCUDA(BackendConformance):
    """Every conformance case with both sides' tensors on cuda:0, in separate processes."""

    backend = "ipc"
    device = "cuda:0"
    timeout_s = 10.0


@pytest.mark.gpu
def test_qwen3_1_7b_shaped_bf16_round_trip_between_two_processes_on_one_gpu():
    model = build("qwen3-1.7b", seed=1, device="cuda:0", fill="constant")
    with spawn_receiver("ipc", model="qwen3-1.7b", seed=2, device="cuda:0",
                        fill="constant") as child:
        client = RPCClient(child.address, timeout_s=120)
        assert client.fingerprint() != wtransfer.fingerprint(model.state_dict())
        info = IPCTrainerInitInfo(bucket_bytes=256 << 20, checksum=True, timeout_s=120)
        with wtransfer.trainer_init(info, client=client,
                                    source=wtransfer.ModuleSource(model)) as sender:
            stats = sender.send_weights(weight_version="gpu")
        assert client.fingerprint() == wtransfer.fingerprint(model.state_dict())
        print(f"\nqwen3-1.7b bf16 over CUDA IPC: {stats.bytes / 1e9:.2f} GB in "
              f"{stats.seconds * 1e3:.1f} ms = {stats.gbps:.1f} GB/s (checksummed)")


@pytest.mark.gpu
def test_packed_cuda_staging_without_a_bucket_size_takes_gigabyte_buckets():
    """A packed update through CUDA staging with no `bucket_bytes` uses `CUDA_BUCKET_BYTES`
    buckets (a 3.4 GB model: 4 of them) in up to `CUDA_NUM_BUFFERS` slots, or the model's
    size where that is less (in one slot); a zero-copy sender keeps the general defaults for
    what it cannot share."""
    from wtransfer_ipc import CUDA_BUCKET_BYTES, CUDA_NUM_BUFFERS

    from wtransfer.records import DEFAULT_BUCKET_BYTES, DEFAULT_NUM_BUFFERS

    model = build("qwen3-1.7b", seed=1, device="cuda:0", fill="constant")
    with spawn_receiver("ipc", model="qwen3-1.7b", seed=2, device="cuda:0",
                        fill="constant") as child:
        client = RPCClient(child.address, timeout_s=120)
        info = IPCTrainerInitInfo(zero_copy=False, timeout_s=120)
        with wtransfer.trainer_init(info, client=client,
                                    source=wtransfer.ModuleSource(model)) as sender:
            stats = sender.send_weights()
            assert sender.bucket_bytes == CUDA_BUCKET_BYTES
            assert sender.num_buffers == CUDA_NUM_BUFFERS == 4
        assert client.fingerprint() == wtransfer.fingerprint(model.state_dict())
        assert stats.buckets == -(-stats.bytes // CUDA_BUCKET_BYTES) == 4
    small = build_module(mixed_metas(2), seed=3, device="cuda:0")
    total = sum(t.numel() * t.element_size() for t in small.state_dict().values())
    for info, expected, slots in [
            (IPCTrainerInitInfo(zero_copy=False), -(-total >> 20) << 20, 1),
            (IPCTrainerInitInfo(), DEFAULT_BUCKET_BYTES, DEFAULT_NUM_BUFFERS)]:
        held = build_module(mixed_metas(2), seed=4, device="cuda:0")
        engine = wtransfer.create_receiver("ipc", wtransfer.ModuleTarget(held), device="cuda:0")
        with wtransfer.trainer_init(info, client=wtransfer.LocalClient(engine),
                                    source=wtransfer.ModuleSource(small)) as sender:
            assert (sender.bucket_bytes, sender.num_buffers) == (expected, slots)
            sender.send_weights()
        assert wtransfer.fingerprint(held.state_dict()) == \
            wtransfer.fingerprint(small.state_dict())
        engine.shutdown()


def send_changed_weights_through_two_slots(trainer, client, *, trainer_busy: bool) -> None:
    """Three updates of changed weights, each more buckets than two staging slots hold (every
    slot reused); each lands bit-exact. With `trainer_busy` the trainer's GPU spins before it
    writes the new weights."""
    info = IPCTrainerInitInfo(bucket_bytes=256 << 10, num_buffers=2, zero_copy=False,
                              timeout_s=60)
    with wtransfer.trainer_init(info, client=client,
                                source=wtransfer.ModuleSource(trainer)) as sender:
        for step in range(3):
            if trainer_busy:
                torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time before the writes
            with torch.no_grad():
                for p in trainer.parameters():
                    p.add_(step + 1)
            stats = sender.send_weights(weight_version=str(step))
            assert stats.buckets > 2 * info.num_buffers
            assert client.fingerprint() == wtransfer.fingerprint(trainer.state_dict())


@pytest.mark.gpu
def test_packed_buckets_are_read_only_after_the_trainer_packed_them():
    """No host synchronization per bucket: the engine's stream waits on the trainer's IPC
    event. The trainer's GPU is kept busy (a spin kernel) before it writes the new weights,
    so a receiver that read its staging without waiting would copy stale bytes."""
    trainer = build("mixed", seed=1, device="cuda:0")
    with spawn_receiver("ipc", model="mixed", seed=2, device="cuda:0") as child:
        send_changed_weights_through_two_slots(
            trainer, RPCClient(child.address, timeout_s=60), trainer_busy=True)


@pytest.mark.gpu
def test_busy_engines_answer_before_reading_and_the_trainer_waits_for_their_reads():
    """Each engine answers a packed bucket once its reads are queued: it records the
    trainer's event for that slot instead of waiting on its host. Both engines' GPU streams
    are kept busy (as by generation), so their reads run long after they answered; a trainer
    that packed a later bucket into the slot without waiting on every engine's event would
    overwrite bytes not yet read."""
    trainer = build("mixed", seed=1, device="cuda:0")
    with spawn_receiver("ipc", model="mixed", seed=2, device="cuda:0", gpu_busy=True) as a, \
            spawn_receiver("ipc", model="mixed", seed=3, device="cuda:0", gpu_busy=True) as b:
        client = wtransfer.FanoutClient([RPCClient(a.address, timeout_s=60),
                                         RPCClient(b.address, timeout_s=60)])
        send_changed_weights_through_two_slots(trainer, client, trainer_busy=False)
        client.close()


@pytest.mark.gpu
def test_same_process_receiver_uses_the_staging_buffers_directly():
    metas = mixed_metas(layers=4)
    trainer, engine_model = build_module(metas, 1, "cuda:0"), build_module(metas, 2, "cuda:0")
    pointers = [p.data_ptr() for p in engine_model.parameters()]
    engine = wtransfer.create_receiver("ipc", wtransfer.ModuleTarget(engine_model),
                                       device="cuda:0")
    client = wtransfer.LocalClient(engine)
    with wtransfer.trainer_init(IPCTrainerInitInfo(bucket_bytes=64 << 10), client=client,
                                source=wtransfer.ModuleSource(trainer)) as sender:
        for step in range(3):
            with torch.no_grad():
                for p in trainer.parameters():
                    p.mul_(1.5)
            sender.send_weights(weight_version=str(step))
            assert client.fingerprint() == wtransfer.fingerprint(trainer.state_dict())
    assert [p.data_ptr() for p in engine_model.parameters()] == pointers
    engine.shutdown()


@pytest.mark.gpu
def test_cpu_trainer_into_gpu_engine():
    metas = mixed_metas(layers=4)
    trainer = build_module(metas, 1, "cpu")
    engine_model = build_module(metas, 2, "cuda:0")
    engine = wtransfer.create_receiver("ipc", wtransfer.ModuleTarget(engine_model),
                                       device="cuda:0")
    client = wtransfer.LocalClient(engine)
    with wtransfer.trainer_init(IPCTrainerInitInfo(bucket_bytes=64 << 10), client=client,
                                source=wtransfer.ModuleSource(trainer)) as sender:
        sender.send_weights()
    assert client.fingerprint() == wtransfer.fingerprint(trainer.state_dict())
    engine.shutdown()



@pytest.mark.gpu
def test_pinned_host_trainer_stages_on_the_gpu_by_default():
    """A lone sender of pinned host tensors stages through CUDA without being asked (one
    host-to-device copy per byte); pageable tensors, or `device="cpu"`, keep shared memory.
    Every way lands bit-exact in another process's GPU engine."""
    metas = mixed_metas()  # the receiver child's "mixed" model
    pinned = build_module(metas, 1, "cpu")
    for tensor in [*pinned.parameters(), *pinned.buffers()]:
        tensor.data = tensor.data.pin_memory()
    assert all(t.is_pinned() for t in pinned.state_dict().values() if t.numel())  # (empty
    # tensors are never pinned: the model's two empty buffers must not cost the fast path)
    pageable = build_module(metas, 3, "cpu")
    with spawn_receiver("ipc", model="mixed", seed=2, device="cuda:0") as child:
        client = RPCClient(child.address, timeout_s=60)
        for module, info, staging in [
                (pinned, IPCTrainerInitInfo(timeout_s=60), "cuda"),
                (pageable, IPCTrainerInitInfo(timeout_s=60), "cpu"),
                (pinned, IPCTrainerInitInfo(device="cpu", timeout_s=60), "cpu")]:
            with wtransfer.trainer_init(info, client=client,
                                        source=wtransfer.ModuleSource(module)) as sender:
                sender.send_weights()
                assert sender.device.type == staging
            assert client.fingerprint() == wtransfer.fingerprint(module.state_dict())

@pytest.mark.gpu
def test_pinned_host_trainer_falls_back_to_shared_memory_for_an_engine_without_the_gpu(caplog):
    """The default CUDA staging of pinned host tensors needs an engine that can map this GPU;
    one that sees none (CUDA_VISIBLE_DEVICES empty) fails that init, and the sender connects
    again through shared memory, says so, and the update lands bit-exact."""
    metas = mixed_metas()
    pinned = build_module(metas, 1, "cpu")
    for tensor in [*pinned.parameters(), *pinned.buffers()]:
        tensor.data = tensor.data.pin_memory()
    with spawn_receiver("ipc", model="mixed", seed=2, device="cpu",
                        env={"CUDA_VISIBLE_DEVICES": ""}) as child:
        client = RPCClient(child.address, timeout_s=60)
        with caplog.at_level("WARNING", logger="wtransfer"), \
                wtransfer.trainer_init(IPCTrainerInitInfo(timeout_s=60), client=client,
                                       source=wtransfer.ModuleSource(pinned)) as sender:
            sender.send_weights()
            assert sender.device.type == "cpu"
        assert "staging through shared memory instead" in caplog.text
        assert client.fingerprint() == wtransfer.fingerprint(pinned.state_dict())


@pytest.mark.gpu
def test_zero_copy_updates_follow_in_place_changes_and_replaced_storages():
    model = build("qwen3-1.7b", seed=1, device="cuda:0", fill="constant")
    with spawn_receiver("ipc", model="qwen3-1.7b", seed=2, device="cuda:0",
                        fill="constant") as child:
        client = RPCClient(child.address, timeout_s=120)
        with wtransfer.trainer_init(IPCTrainerInitInfo(timeout_s=120), client=client,
                                    source=wtransfer.ModuleSource(model)) as sender:
            stats = sender.send_weights(weight_version="zc-0")
            assert client.fingerprint() == wtransfer.fingerprint(model.state_dict())
            with torch.no_grad():
                for p in model.parameters():  # an optimizer step: same storages
                    p.mul_(1.5)
            sender.send_weights(weight_version="zc-1")
            assert client.fingerprint() == wtransfer.fingerprint(model.state_dict())
            first = next(model.parameters())
            first.data = first.data * 2  # a new storage: exported again
            sender.send_weights(weight_version="zc-2")
            assert client.fingerprint() == wtransfer.fingerprint(model.state_dict())
        print(f"\nqwen3-1.7b bf16 zero-copy: {stats.bytes / 1e9:.2f} GB in "
              f"{stats.seconds * 1e3:.1f} ms = {stats.gbps:.1f} GB/s")


@pytest.mark.gpu
def test_a_zero_copy_update_holding_a_nan_in_a_large_tensor_is_refused_and_rolled_back():
    """A zero-copy update checks each large tensor as it copies it (one read): a NaN in
    the largest tensor is refused naming it, and with rollback on the engine holds what it
    held; the next clean update lands bit-exact."""
    model = build("qwen3-0.6b", seed=1, device="cuda:0", fill="constant")
    with spawn_receiver("ipc", model="qwen3-0.6b", seed=2, device="cuda:0",
                        fill="constant", rollback=True) as child:
        client = RPCClient(child.address, timeout_s=120)
        with wtransfer.trainer_init(IPCTrainerInitInfo(timeout_s=120), client=client,
                                    source=wtransfer.ModuleSource(model)) as sender:
            sender.send_weights(weight_version="clean")
            before = client.fingerprint()
            tensors = model.state_dict()
            largest = max(tensors, key=lambda n: tensors[n].nbytes)
            with torch.no_grad():
                tensors[largest].view(-1)[-1] = float("nan")
            with pytest.raises(wtransfer.errors.NonFiniteError,
                               match=f"'{largest}' holds NaN or infin"):
                sender.send_weights(weight_version="diverged")
            assert client.fingerprint() == before
            assert client.status()["weight_version"] == "clean"
            with torch.no_grad():
                tensors[largest].view(-1)[-1] = 0.5
            sender.send_weights(weight_version="clean-2")
            assert client.fingerprint() == wtransfer.fingerprint(model.state_dict())


@pytest.mark.gpu
def test_a_zero_copy_layout_outside_its_storage_is_refused_before_any_write():
    metas = mixed_metas(layers=2)
    trainer, engine_model = build_module(metas, 1, "cuda:0"), build_module(metas, 2, "cuda:0")
    engine = wtransfer.create_receiver("ipc", wtransfer.ModuleTarget(engine_model),
                                       device="cuda:0")
    client = wtransfer.LocalClient(engine)
    before = wtransfer.fingerprint(engine_model.state_dict())
    with wtransfer.trainer_init(IPCTrainerInitInfo(), client=client,
                                source=wtransfer.ModuleSource(trainer)) as sender:
        exports = sender._zero_copy
        tensors = [t for _, t in sender.source.tensors()]
        update = exports.update(tensors)
        layout = array("q", update["layout"])  # each tensor's storage and byte offset
        layout[2 * 3 + 1] += 1 << 40  # tensor 3, past the end of its storage
        update["layout"] = layout.tobytes()
        engine.start_weight_update()
        manifest = [m.to_wire() for m in sender.source.metadata()]
        with pytest.raises(wtransfer.errors.MetadataError, match="does not fit"):
            engine.update_weights({"tensors": manifest, "zero_copy": update})
    assert wtransfer.fingerprint(engine_model.state_dict()) == before
    assert engine.torn is False
    engine.shutdown()


@pytest.mark.gpu
def test_two_trainer_processes_on_one_gpu_stage_half_each_through_cuda_ipc():
    """M->N through CUDA staging: two trainer processes on cuda:0, each holding the model
    (replicas: FSDP2 needs a GPU per rank), each stage about half of it in their own CUDA
    IPC buffers, ordered by IPC events; the receiver on the same GPU holds it bit-exact."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from wtransfer.launch.trainer_ranks import TrainerRanks

    with spawn_receiver("ipc", model="mixed", seed=2, device="cuda:0") as receiver:
        with TrainerRanks(2, backend="ipc", addresses=[receiver.address], senders=2,
                          updates=2, device="cuda:0", fingerprint=True, timeout_s=120,
                          init_fields={"m2n": True, "bucket_bytes": 1 << 20,
                                       "timeout_s": 60.0}) as trainers:
            outs = [trainers.wait_for(r, "sent", 300, count=2) for r in range(2)]
            assert trainers.wait(60) == [0, 0], trainers.stderr(0)[-2000:]
        client = RPCClient(receiver.address, timeout_s=30)
        assert client.fingerprint() == outs[0]["fingerprint"]
        client.close()
    sent = [o["sent_bytes"] for o in outs]
    assert sum(sent) == outs[0]["bytes"] and min(sent) > 0.3 * outs[0]["bytes"]


@pytest.mark.gpu
def test_a_zero_copy_update_into_a_tp_engine_reads_and_checks_each_workers_part_only():
    """One trainer process, zero-copy into our engine with two TP workers on cuda:0: each
    worker copies only the parts it keeps (its received bytes are its kept bytes) and the
    engine holds the trainer's weights bit-exact; a NaN in a row-parallel tensor (a strided
    part) and an infinity in a column-parallel one (a contiguous part, checked in its copy)
    are each refused naming the tensor, the engine's weights unchanged; the next clean
    update lands."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from wtransfer.demos.rl.servers import HTTPPolicyServer
    from wtransfer.inference.model.decoder import load_model

    trainer = load_model("qwen3-0.6b", seed=3, device="cuda:0")
    server = HTTPPolicyServer(model="qwen3-0.6b", seed=2, backend="ipc",
                              tensor_parallel_size=2, device="cuda:0", start_timeout_s=300)
    try:
        client = server.client
        with wtransfer.trainer_init(IPCTrainerInitInfo(timeout_s=120), client=client,
                                    source=wtransfer.ModuleSource(trainer)) as sender:
            sender.send_weights(weight_version="clean")
            assert client.fingerprint() == wtransfer.fingerprint(trainer.state_dict())
            workers = server.weight_info()["workers"]
            kept = [w["kept_bytes"] for w in workers]
            assert [w["last_update_bytes"] for w in workers] == kept
            model_bytes = sum(t.nbytes for t in trainer.state_dict().values())
            assert all(k < 0.6 * model_bytes for k in kept), (kept, model_bytes)
            before = client.fingerprint()
            state = trainer.state_dict()
            for name, bad in (("model.layers.3.self_attn.o_proj.weight", float("nan")),
                              ("model.layers.5.mlp.up_proj.weight", float("inf"))):
                with torch.no_grad():
                    state[name][-1, -1] = bad
                with pytest.raises(wtransfer.errors.NonFiniteError,
                                   match=f"'{name}' holds NaN or infin"):
                    sender.send_weights(weight_version="diverged")
                assert client.fingerprint() == before
                with torch.no_grad():
                    state[name][-1, -1] = 0.25
            sender.send_weights(weight_version="clean-2")
            assert client.fingerprint() == wtransfer.fingerprint(trainer.state_dict())
            assert client.get_weight_version() == "clean-2"
    finally:
        server.close()
