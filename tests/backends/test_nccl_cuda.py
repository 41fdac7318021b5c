"""The CUDA paths of the nccl backend that one GPU allows (the cross-GPU run needs two)."""

import pytest
import torch
from wtransfer_nccl import NCCLTrainerInitInfo
from wtransfer_nccl.group import NCCLGroup, host_rendezvous, session_store
from wtransfer_nccl.libnccl import load_nccl

import wtransfer
from wtransfer.control.rpc import RPCClient
from wtransfer.errors import PeerError
from wtransfer.launch.models import build
from wtransfer.launch.processes import spawn_receiver

pytestmark = pytest.mark.gpu


def test_binding_loads_and_a_world_of_one_broadcasts_on_its_own_stream():
    lib = load_nccl()
    print(f"\nlibnccl {lib.path} version {lib.version()}")
    assert lib.version() >= 21800
    store = session_store(host_rendezvous("127.0.0.1", 0, 30), "gpu-test")
    group = NCCLGroup(store, 0, 1, 30, torch.device("cuda:0"))
    data = torch.randint(0, 256, (64 << 20,), dtype=torch.uint8, device="cuda:0")
    want = data.clone()
    for _ in range(3):
        group.broadcast([data]).wait(30)
    assert torch.equal(data, want)
    group.raise_async_error()
    group.close()


def test_aborted_communicator_refuses_further_work():
    store = session_store(host_rendezvous("127.0.0.1", 0, 30), "gpu-abort")
    group = NCCLGroup(store, 0, 1, 30, torch.device("cuda:0"))
    group.abort()
    with pytest.raises(PeerError, match="torn down"):
        group.broadcast([torch.zeros(8, dtype=torch.uint8, device="cuda:0")])


def test_cuda_tensors_over_gloo_staging_between_two_processes_on_one_gpu():
    model = build("mixed", seed=1, device="cuda:0")
    with spawn_receiver("nccl", model="mixed", seed=2, device="cuda:0") as child:
        client = RPCClient(child.address, timeout_s=60)
        info = NCCLTrainerInitInfo(master_address="127.0.0.1",
                                   world_size=2, device="cpu", bucket_bytes=1 << 20,
                                   checksum=True, timeout_s=60)
        with wtransfer.trainer_init(info, client=client,
                                    source=wtransfer.ModuleSource(model)) as sender:
            sender.send_weights()
        assert client.fingerprint() == wtransfer.fingerprint(model.state_dict())
