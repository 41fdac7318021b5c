"""Fixtures of the backend tests."""

import pytest
from m2n_helpers import Serve


@pytest.fixture
def serve():
    servers = []

    def start(*flags, backend="nccl"):
        servers.append(Serve(*flags, backend=backend))
        return servers[-1]

    yield start
    for server in servers:
        server.close()
