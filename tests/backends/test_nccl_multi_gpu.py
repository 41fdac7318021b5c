"""The nccl backend across GPUs: the trainer on cuda:0, one receiver process per other GPU.

Runs every conformance case (bit-exact round trip, checksums, several workers, subset update,
mismatch refused, 20 senders in a row with prompt teardown and flat memory, a receiver or the
trainer killed mid-transfer) over real NCCL between GPUs. Needs two GPUs or more.
"""

import pytest
import torch

from wtransfer.testing.conformance import BackendConformance

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(GPUS < 2, reason=f"needs 2 CUDA devices, found {GPUS}")]


class TestNCCLAcrossGPUs(BackendConformance):
    backend = "nccl"
    device = "cuda:0"
    receiver_devices = tuple(f"cuda:{i}" for i in range(1, max(GPUS, 2)))
    workers = max(1, min(3, GPUS - 1))
    """NCCL refuses two ranks of one communicator on one GPU: one worker per other GPU."""
    timeout_s = 20.0

    def init_fields(self, workers):
        return {"master_address": "127.0.0.1", "world_size": 1 + workers}
