"""The shipped conformance suite on the nccl backend over gloo (CPU, real processes)."""

import socket

from wtransfer.testing.conformance import BackendConformance


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class TestNCCLConformanceGloo(BackendConformance):
    backend = "nccl"
    workers = 3

    def init_fields(self, workers):
        return {"master_address": "127.0.0.1", "master_port": free_port(),
                "world_size": 1 + workers}
