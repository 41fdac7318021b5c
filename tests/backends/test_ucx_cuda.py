"""The CUDA path of the ucx backend: device buffers between two processes on one GPU."""

import pytest

import wtransfer
from wtransfer.control.rpc import RPCClient
from wtransfer.launch.models import build
from wtransfer.launch.processes import spawn_receiver
from wtransfer.testing.conformance import BackendConformance

ucx = pytest.importorskip("wtransfer_ucx.transport", reason="UCXX is not installed")


@pytest.mark.gpu
class TestUCXConformanceCUDA(BackendConformance):
    """Every conformance case with both sides' tensors on cuda:0, in separate processes,
    moved by tagged buckets (`rma=False`)."""

    backend = "ucx"
    device = "cuda:0"
    timeout_s = 20.0

    def init_fields(self, workers: int) -> dict[str, object]:
        return {"rma": False}


@pytest.mark.gpu
class TestUCXRemoteReadsConformanceCUDA(TestUCXConformanceCUDA):
    """The same cases with the default `rma=None`, which on one host with CUDA tensors moves
    them by one-sided reads out of the trainer's memory."""

    def init_fields(self, workers: int) -> dict[str, object]:
        return {}


@pytest.mark.gpu
def test_reads_are_chosen_for_cuda_tensors_on_one_host_and_tagged_buckets_elsewhere():
    """`rma=None`: one-sided reads for CUDA tensors with a loopback listen address; tagged
    buckets when the listen address may take other hosts, or when asked; each choice says
    why, and every update lands bit-exact."""
    from wtransfer_ucx import UCXTrainerInitInfo

    model = build("demo", seed=1, device="cuda:0")
    cases = [({}, True, "one-sided reads: CUDA tensors, cuda_ipc, every worker on this host"),
             ({"listen_address": "0.0.0.0"}, False, "may take workers on other hosts"),
             ({"rma": False}, False, "tagged buckets (rma=False)")]
    for fields, reads, why in cases:
        with spawn_receiver("ucx", model="demo", seed=2, device="cuda:0") as child:
            client = RPCClient(child.address, timeout_s=60)
            info = UCXTrainerInitInfo(timeout_s=60, **fields)
            with wtransfer.trainer_init(info, client=client,
                                        source=wtransfer.ModuleSource(model)) as sender:
                sender.send_weights()
                assert sender.reads.on is reads and why in sender.reads.reason
            assert client.fingerprint() == wtransfer.fingerprint(model.state_dict())


@pytest.mark.gpu
@pytest.mark.parametrize(("bucket_mb", "rma"), [(256, False), (1024, False), (1024, True)])
def test_qwen3_1_7b_shaped_cuda_tensors_over_ucx(bucket_mb, rma):
    from wtransfer_ucx import UCXTrainerInitInfo

    model = build("qwen3-1.7b", seed=1, device="cuda:0", fill="constant")
    with spawn_receiver("ucx", model="qwen3-1.7b", seed=2, device="cuda:0",
                        fill="constant") as child:
        client = RPCClient(child.address, timeout_s=300)
        info = UCXTrainerInitInfo(bucket_bytes=bucket_mb << 20, timeout_s=300, rma=rma)
        with wtransfer.trainer_init(info, client=client,
                                    source=wtransfer.ModuleSource(model)) as sender:
            sender.send_weights()
            stats = [sender.send_weights() for _ in range(3)]
            print(f"\nUCX worker: {sender._ucx.transports()[:600]}")
        assert client.fingerprint() == wtransfer.fingerprint(model.state_dict())
        best = max(s.gbps for s in stats)
        print(f"qwen3-1.7b bf16 CUDA->CUDA over UCX, {'reads' if rma else bucket_mb}: "
              f"{stats[0].bytes / 1e9:.2f} GB, best {best:.1f} GB/s")
