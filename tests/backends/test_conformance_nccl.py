"""The shipped conformance suite on the nccl backend over gloo (CPU, real processes)."""

from wtransfer.processes import free_port
from wtransfer.testing.conformance import BackendConformance


class TestNCCLConformanceGloo(BackendConformance):
    backend = "nccl"
    workers = 3

    def init_fields(self, workers):
        return {"master_address": "127.0.0.1", "master_port": free_port(),
                "world_size": 1 + workers}
