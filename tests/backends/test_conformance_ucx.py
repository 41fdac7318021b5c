"""The shipped conformance suite on the ucx backend (UCXX, real processes, host memory)."""

import pytest

from wtransfer.errors import TransferTimeout
from wtransfer.testing.conformance import BackendConformance

pytest.importorskip("ucxx", reason="UCXX is not installed (pip install 'wtransfer-ucx[cu12]')")


class TestUCXConformance(BackendConformance):
    backend = "ucx"
    workers = 2
    timeout_s = 10.0  # a UCX init (worker, listener, endpoints) once took over 5 s on the
    # 2-core VM while the whole suite ran beside it (20 in a row take 10 s alone)


class TestUCXRemoteReadsConformance(BackendConformance):
    """The same suite with every update moved by one-sided reads out of the trainer's memory
    (`rma=True`; UCX emulates them over TCP here)."""

    backend = "ucx"
    workers = 2
    timeout_s = 10.0

    def init_fields(self, workers: int) -> dict[str, object]:
        return {"rma": True}


def test_one_sided_reads_follow_a_replaced_tensor_and_refuse_bad_reads_before_any_write():
    """With one-sided reads the trainer registers each tensor once; a parameter whose storage
    is replaced is registered again (the old memory no longer readable) and lands. A read
    naming a key the worker was never sent, or reaching past its registration, is refused
    with the tensor's name before any weight changes."""
    from array import array

    from wtransfer_ucx import UCXTrainerInitInfo

    import wtransfer
    from wtransfer.control.rpc import RPCClient
    from wtransfer.errors import RemoteMetadataError
    from wtransfer.launch.models import build
    from wtransfer.launch.processes import spawn_receiver
    from wtransfer.packing import metas_to_wire

    model = build("mixed", seed=1, device="cpu")
    with spawn_receiver("ucx", model="mixed", seed=2) as child:
        client = RPCClient(child.address, timeout_s=30)
        info = UCXTrainerInitInfo(rma=True, timeout_s=10)
        with wtransfer.trainer_init(info, client=client,
                                    source=wtransfer.ModuleSource(model)) as sender:
            sender.send_weights("v1")
            param = next(iter(model.parameters()))
            param.data = param.data.clone() + 1  # a new storage for one tensor
            sender.send_weights("v2")
            assert client.fingerprint() == wtransfer.fingerprint(model.state_dict())
            landed = client.fingerprint()
            metas = wtransfer.ModuleSource(model).metadata()
            pairs = array("q")
            for tensor in wtransfer.ModuleSource(model).held():
                pairs.extend((tensor.data_ptr(), 10_000))  # a key never sent
            unknown = {"keys": [], "reads": pairs.tobytes(), "drop": []}
            first = metas[0]
            past = array("q", pairs)
            past[1] = 7
            outside = {"keys": [[7, past[0], first.nbytes - 1, b"\0" * 8]],
                       "reads": past.tobytes(), "drop": []}
            cases = [(unknown, f"tensor '{first.name}' names rma key 10000, which this "
                               "worker was never sent"),
                     (outside, f"tensor '{first.name}' .* lies outside its rma registration")]
            for rma, message in cases:
                client.start_weight_update()
                with pytest.raises(RemoteMetadataError, match=message):
                    client.update_weights({"tensors": metas_to_wire(metas), "update": 99,
                                           "rma": rma})
                assert client.fingerprint() == landed
        client.close()


def test_one_sided_reads_take_a_yielding_source_and_fall_back_for_a_strided_tensor():
    """A source that only yields its tensors (no `held` list) is walked once: contiguous, it
    moves by one-sided reads; with one strided tensor (a transposed view) the same update
    moves by tagged buckets from a fresh walk. Both land bit-exact, twice in a row."""
    from wtransfer_ucx import UCXTrainerInitInfo

    import wtransfer
    from wtransfer.control.rpc import RPCClient
    from wtransfer.launch.models import build
    from wtransfer.launch.processes import spawn_receiver
    from wtransfer.shapes import randomize
    from wtransfer.trainer.source import WeightSource

    class Yielding(WeightSource):
        def __init__(self, state: dict) -> None:
            self.state = state

        def metadata(self):
            return wtransfer.ModuleSource(model).metadata()

        def tensors(self):
            yield from self.state.items()

    model = build("mixed", seed=1, device="cpu")
    names = [m.name for m in wtransfer.ModuleSource(model).metadata()]
    state = dict(zip(names, wtransfer.ModuleSource(model).held(), strict=True))
    square = next(n for n, t in state.items() if t.dim() == 2 and t.shape[0] == t.shape[1])
    with spawn_receiver("ucx", model="mixed", seed=2) as child:
        client = RPCClient(child.address, timeout_s=30)
        for strided in (False, True):
            if strided:  # same values, transposed memory
                state[square].data = state[square].data.t().contiguous().t()
                assert not state[square].is_contiguous()
            with wtransfer.trainer_init(UCXTrainerInitInfo(rma=True, timeout_s=10),
                                        client=client, source=Yielding(state)) as sender:
                for step in range(2):
                    randomize(model, 10 * strided + step)  # in place: strides kept
                    sender.send_weights()
                    assert client.fingerprint() == wtransfer.fingerprint(model.state_dict())
        client.close()


def test_one_sided_reads_into_a_target_without_storage_of_its_own_land_bit_exact():
    """Reads into temporaries (a loader target, as vLLM's) are bounded by the staging budget
    (two 4 KiB buffers here, far less than the model): a batch is loaded once it landed and
    the next one starts. Bit-exact twice in a row."""
    from wtransfer_ucx import UCXTrainerInitInfo

    from wtransfer.testing.targets import assert_lands_in_loader_target

    assert_lands_in_loader_target("ucx", UCXTrainerInitInfo(rma=True, timeout_s=10,
                                                            bucket_bytes=4096, num_buffers=2))


def test_ucx_contexts_enable_cuda_ipc_reads_unless_the_environment_decides(monkeypatch):
    """Without the option UCX serves reads of GPU memory by software emulation over TCP on a
    machine without NVLinks; a user's own `UCX_CUDA_IPC_ENABLE_GET_ZCOPY` wins."""
    from wtransfer_ucx.transport import context_options

    monkeypatch.delenv("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", raising=False)
    assert context_options() == {"CUDA_IPC_ENABLE_GET_ZCOPY": "y"}
    monkeypatch.setenv("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "n")
    assert context_options() == {}


@pytest.mark.parametrize("rma", [False, True], ids=["tagged", "reads"])
def test_an_unchanged_tensor_list_travels_as_its_digest(rma):
    """Only the first update of a sender carries the tensor list; later ones name it by
    digest (about 40 KB less to encode, send and parse per update of a 400-tensor model)."""
    from wtransfer_ucx import UCXTrainerInitInfo

    from wtransfer.testing.tensor_lists import assert_the_list_travels_once

    sent, _ = assert_the_list_travels_once("ucx", UCXTrainerInitInfo(rma=rma, timeout_s=10))
    assert all(("rma" in fields) == rma for fields in sent)


def test_an_update_naming_an_unknown_tensor_list_is_refused_before_any_weight_changes():
    from wtransfer_ucx import UCXTrainerInitInfo

    from wtransfer.testing.tensor_lists import assert_an_unknown_list_is_refused

    assert_an_unknown_list_is_refused("ucx", UCXTrainerInitInfo(timeout_s=10))


@pytest.mark.parametrize(("env", "reads"), [
    ({}, True), ({"UCX_TLS": "tcp,cuda_copy,cuda_ipc"}, True), ({"UCX_TLS": "all"}, True),
    ({"UCX_TLS": "tcp,cuda_copy"}, False), ({"UCX_TLS": "^cuda_ipc"}, False),
    ({"UCX_TLS": "^tcp"}, True), ({"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "n"}, False),
    ({"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y"}, True)])
def test_reads_of_gpu_memory_count_on_cuda_ipc_only_where_the_environment_leaves_it(
        monkeypatch, env, reads):
    """`rma=None` reads GPU memory only through a cuda_ipc that UCX loaded and the
    environment neither leaves out (`UCX_TLS`) nor keeps from serving reads."""
    from wtransfer_ucx.transport import cuda_ipc_reads

    for name in ("UCX_TLS", "UCX_CUDA_IPC_ENABLE_GET_ZCOPY"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert cuda_ipc_reads(True) is reads
    assert cuda_ipc_reads(False) is False


def test_host_tensors_move_as_tagged_buckets_by_default_and_say_why():
    """`rma=None` with the trainer's tensors in host memory: tagged buckets, and the sender
    says so (reads are for GPU memory on one host)."""
    from wtransfer_ucx import UCXTrainerInitInfo

    import wtransfer
    from wtransfer.launch.models import build

    source, held = build("mixed", seed=1, device="cpu"), build("mixed", seed=2, device="cpu")
    engine = wtransfer.create_receiver("ucx", wtransfer.ModuleTarget(held))
    with wtransfer.trainer_init(UCXTrainerInitInfo(timeout_s=10),
                                client=wtransfer.LocalClient(engine),
                                source=wtransfer.ModuleSource(source)) as sender:
        sender.send_weights()
        assert not sender.reads.on and "not all on CUDA" in sender.reads.reason
    assert wtransfer.fingerprint(held.state_dict()) == wtransfer.fingerprint(source.state_dict())
    engine.shutdown()


@pytest.mark.parametrize(("message", "error"), [
    ({"trainers": [[]], "workers": []}, "lists no workers"),
    ({"trainers": [[]], "workers": [[["w", "bfloat17", [2], [[[0], [2]]], 0, 0]]]},
     "unknown dtype"),
    ({"trainers": [[]], "workers": [[]]}, "lists 1 workers; this is worker 3"),
    ([1, 2], "must be a mapping"),
])
def test_a_malformed_m2n_roster_is_refused_by_name(message, error):
    """What the lead trainer rank tells an M->N worker at its first update travels over UCX
    as a typed message: a roster that lists no workers, a layout of an unknown dtype, too few
    workers, or no mapping at all is refused with what is wrong (`MetadataError`)."""
    from wtransfer_ucx import m2n
    from wtransfer_ucx.transport import acquire_worker, control_tag, release_worker

    from wtransfer import wire
    from wtransfer.errors import MetadataError

    worker, trainer = acquire_worker(), acquire_worker()
    try:
        ep = trainer.connect("127.0.0.1", worker.listen(0))
        sent = trainer.send_message(ep, wire.encode(message), control_tag(7, 2, 3))
        with pytest.raises(MetadataError, match=error):
            m2n.read_roster(worker, 7, 3, 10.0, 4096)
        trainer.wait(sent.requests, 10.0)
        with pytest.raises(TransferTimeout, match="roster from trainer rank 0 did not arrive"):
            m2n.read_roster(worker, 7, 3, 0.2, 4096)  # nothing more was sent
    finally:
        release_worker(trainer)
        release_worker(worker)
