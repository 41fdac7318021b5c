"""The shipped conformance suite, run on the ipc backend (POSIX shared memory on CPU)."""

from wtransfer.testing.conformance import BackendConformance


class TestIPCConformance(BackendConformance):
    backend = "ipc"
