"""Over ipc through shared memory, sharded trainer ranks that each hold a client go M->N
without asking (`IPCTrainerInitInfo.m2n` None): each rank stages its own shards and nothing is
gathered. A tensor no rank holds as one box (a `Partial` sum here; FSDP2 over a
tensor-parallel dimension likewise) makes every rank gather instead: the update lands, no
`ConfigError`. One rank in a process group of one, in a child process (its default group is
the process's)."""

import json
import subprocess
import sys

import pytest

RANK = '''
import json, sys, tempfile
import torch, torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Shard
import wtransfer
from wtransfer_ipc import IPCTrainerInitInfo

store = tempfile.TemporaryDirectory()
dist.init_process_group("gloo", init_method=f"file://{store.name}/rendezvous", rank=0,
                        world_size=1)
mesh = init_device_mesh("cpu", (1,))
torch.manual_seed(0)
full = {"a": torch.randn(64, 4), "b": torch.randn(6)}
placements = {"a": [Shard(0)], "b": [Partial()] if sys.argv[1] == "partial" else [Shard(0)]}
trainer, engine = nn.Module(), nn.Module()
for name, tensor in full.items():
    setattr(trainer, name, nn.Parameter(DTensor.from_local(tensor.clone(), mesh,
                                                           placements[name]),
                                        requires_grad=False))
    setattr(engine, name, nn.Parameter(torch.zeros_like(tensor), requires_grad=False))
receiver = wtransfer.create_receiver("ipc", wtransfer.ModuleTarget(engine))
with wtransfer.trainer_init(IPCTrainerInitInfo(timeout_s=30, bucket_bytes=256),
                            client=wtransfer.LocalClient(receiver),
                            source=wtransfer.ModuleSource(trainer)) as sender:
    stats = sender.send_weights("v1")
    print(json.dumps({"m2n": sender.m2n, "gathered": stats.gathered_peak_bytes,
                      "landed": all(torch.equal(getattr(engine, n), t)
                                    for n, t in full.items())}))
receiver.shutdown()
dist.destroy_process_group()
store.cleanup()
'''


@pytest.mark.parametrize(("placement", "m2n"), [("shard", True), ("partial", False)])
def test_sharded_ranks_go_m2n_by_default_unless_a_tensor_is_not_one_box(placement, m2n):
    out = subprocess.run([sys.executable, "-c", RANK, placement], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["landed"] and got["m2n"] == m2n
    assert (got["gathered"] > 0) == (not m2n)  # (gathering: the buckets it sent)
