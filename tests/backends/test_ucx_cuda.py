"""The CUDA path of the ucx backend: device buffers between two processes on one GPU."""

import pytest

import wtransfer
from wtransfer.launch.models import build
from wtransfer.launch.processes import spawn_receiver
from wtransfer.rpc import RPCClient
from wtransfer.testing.conformance import BackendConformance

ucx = pytest.importorskip("wtransfer_ucx.transport", reason="UCXX is not installed")


@pytest.mark.gpu
class TestUCXConformanceCUDA(BackendConformance):
    """Every conformance case with both sides' tensors on cuda:0, in separate processes."""

    backend = "ucx"
    device = "cuda:0"
    timeout_s = 20.0


@pytest.mark.gpu
class TestUCXRemoteReadsConformanceCUDA(TestUCXConformanceCUDA):
    """The same cases moved by one-sided reads out of the trainer's memory (`rma=True`)."""

    def init_fields(self, workers: int) -> dict[str, object]:
        return {"rma": True}


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
