"""The shipped conformance suite on the nccl backend over gloo (CPU, real processes)."""

import socket
import subprocess
import sys
import time

import pytest
from wtransfer_nccl import NCCLTrainerInitInfo

import wtransfer
from wtransfer.control.rpc import RPCClient
from wtransfer.errors import ConfigError
from wtransfer.launch.models import build
from wtransfer.launch.processes import spawn_receiver
from wtransfer.testing.conformance import BackendConformance, wait_for
from wtransfer.testing.targets import assert_lands_in_loader_target
from wtransfer.testing.tensor_lists import (
    assert_an_unknown_list_is_refused,
    assert_the_list_travels_once,
)


class TestNCCLConformanceGloo(BackendConformance):
    backend = "nccl"
    workers = 3

    def init_fields(self, workers):
        return {"master_address": "127.0.0.1", "world_size": 1 + workers}


def test_a_taken_master_port_fails_at_once_naming_the_fix_and_leaves_the_engine_untouched():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with spawn_receiver("nccl", model="mixed", seed=2) as receiver:
            client = RPCClient(receiver.address, timeout_s=30)
            before = client.status()["state"]
            info = NCCLTrainerInitInfo(master_address="127.0.0.1", master_port=port,
                                       world_size=2, timeout_s=20)
            started = time.monotonic()
            with pytest.raises(ConfigError, match=f"could not host the rendezvous at "
                                                  f"127.0.0.1:{port}.*master_port=0"):
                wtransfer.trainer_init(info, client=client,
                                       source=wtransfer.ModuleSource(build("mixed", 1, "cpu")))
            assert time.monotonic() - started < info.timeout_s  # failed, not timed out
            assert client.status()["state"] == before == "new"  # no receiver told to join
            client.close()


def test_every_tensor_direct_in_group_units_lands_bit_exact_over_gloo():
    """The CUDA default's path (every non-empty tensor straight into its parameter, posted in
    units of up to 32), exercised on CPU: the mixed model's 0-d and empty tensors travel in a
    packed bucket between the runs of direct ones. After the first update the unchanged tensor
    list travels as its digest."""
    info = NCCLTrainerInitInfo(master_address="127.0.0.1", world_size=2, timeout_s=60,
                               direct_threshold=1)
    sent, stats = assert_the_list_travels_once("nccl", info)
    assert stats.buckets > stats.tensors // 2  # nearly every tensor was a bucket of its own
    assert sent == [["sender_id", "tensors"], ["sender_id", "tensors_digest"],
                    ["sender_id", "tensors_digest"]]


def test_an_update_naming_an_unknown_tensor_list_is_refused_before_any_weight_changes():
    assert_an_unknown_list_is_refused("nccl", NCCLTrainerInitInfo(
        master_address="127.0.0.1", world_size=2, timeout_s=30))


def test_direct_tensors_into_a_target_without_storage_of_its_own_land_bit_exact():
    """The receiver bounds the temporaries in flight by its staging budget (two 4 KiB
    buffers here, far less than the model), posting later units once earlier ones landed."""
    info = NCCLTrainerInitInfo(master_address="127.0.0.1", world_size=2, timeout_s=30,
                               direct_threshold=1, bucket_bytes=4096, num_buffers=2)
    assert_lands_in_loader_target("nccl", info)


_OPENS_AN_UPDATE_AND_STAYS = """
import sys
import wtransfer
from wtransfer.control.rpc import RPCClient
from wtransfer.launch.models import build
from wtransfer_nccl import NCCLTrainerInitInfo
client = RPCClient(sys.argv[1], timeout_s=60)
info = NCCLTrainerInitInfo(master_address="127.0.0.1", world_size=2, timeout_s=120)
sender = wtransfer.trainer_init(info, client=client,
                                source=wtransfer.ModuleSource(build("mixed", 1, "cpu")))
client.start_weight_update()
print("open", flush=True)
sys.stdin.read()  # until the test kills it
"""


def test_a_trainer_that_dies_between_calls_fails_its_open_update_through_the_lifeline():
    """The trainer opens an update and is killed before its update call (over gloo a kill
    during a broadcast fails it at once anyway; NCCL never notices). The engine fails the
    update well before the trainer's `timeout_s` (120 s; this waits at most 60), naming the
    lifeline, and a new trainer's update then lands."""
    with spawn_receiver("nccl", model="mixed", seed=2) as receiver:
        trainer = subprocess.Popen([sys.executable, "-c", _OPENS_AN_UPDATE_AND_STAYS,
                                    receiver.address], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, text=True)
        client = RPCClient(receiver.address, timeout_s=30)
        try:
            assert trainer.stdout is not None and trainer.stdout.readline().strip() == "open"
            assert client.status()["state"] == "updating"
            trainer.kill()
            trainer.wait(timeout=30)
            wait_for(lambda: client.status()["state"] != "updating", 60,
                     "the engine to fail the dead trainer's update")
            status = client.status()
            assert status["state"] == "failed"
            assert "lifeline connection was reset" in status["failure"]
            model = build("mixed", seed=3, device="cpu")
            info = NCCLTrainerInitInfo(master_address="127.0.0.1", world_size=2, timeout_s=30)
            with wtransfer.trainer_init(info, client=client,
                                        source=wtransfer.ModuleSource(model)) as sender:
                sender.send_weights()
            assert client.fingerprint() == wtransfer.fingerprint(model.state_dict())
        finally:
            trainer.kill()
            trainer.wait(timeout=30)
            client.close()
