"""What a new user gets for common mistakes: one error saying what to fix, never a raw
Python error from deep inside."""

import pytest
import torch
from wtransfer_ipc import IPCTrainerInitInfo
from wtransfer_nccl import NCCLTrainerInitInfo

import wtransfer
from wtransfer.errors import ConfigError


def test_a_module_passed_without_module_source_says_to_wrap_it():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    engine = wtransfer.create_receiver("ipc", wtransfer.ModuleTarget(model))
    with pytest.raises(ConfigError, match=r"wtransfer.ModuleSource\(model\)"):
        wtransfer.trainer_init(IPCTrainerInitInfo(), client=wtransfer.LocalClient(engine),
                               source=model)
    assert engine.state == "new"  # nothing reached the engine
    engine.shutdown()


@pytest.mark.parametrize("field, value", [("bucket_bytes", "64MB"), ("num_buffers", 2.5),
                                          ("checksum", "yes"), ("timeout_s", "10")])
def test_a_mistyped_init_field_is_named(field, value):
    with pytest.raises(ConfigError, match=rf"IPCTrainerInitInfo: field '{field}' must be"):
        IPCTrainerInitInfo(**{field: value})


def test_an_init_info_of_another_backend_is_refused_by_saying_which():
    """An nccl trainer's init info reaching an ipc engine names both backends (not the
    dozen fields the ipc engine does not know), and leaves the engine as it was."""
    model = torch.nn.Linear(4, 4)
    engine = wtransfer.create_receiver("ipc", wtransfer.ModuleTarget(model))
    info = NCCLTrainerInitInfo(master_address="127.0.0.1", world_size=2, timeout_s=5)
    with pytest.raises(ConfigError, match=r"receives through 'ipc', but the trainer sent a "
                                          r"'nccl' init info"):
        wtransfer.trainer_init(info, client=wtransfer.LocalClient(engine),
                               source=wtransfer.ModuleSource(torch.nn.Linear(4, 4)))
    assert engine.state == "new"
    engine.shutdown()


def test_transfer_stats_show_their_throughput():
    stats = wtransfer.TransferStats(bytes=2_000_000_000, tensors=3, buckets=2, seconds=0.5)
    assert "gbps=4.000" in repr(stats) and stats.as_dict()["gbps"] == 4.0
