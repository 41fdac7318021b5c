"""wtransfer: move model weights from an RL trainer into a serving inference engine.

The public surface: the backend registry (`Backend`, `register_backend`, `get_backend`,
`list_backends`, `create_receiver`, `trainer_init`), the lifecycle ABCs
(`WeightTransferEngine`, `TrainerTransferEngine`, `TransferStats`), sources and targets
(`ModuleSource`, `ModuleTarget`, `fingerprint`), clients (`LocalClient`, `FanoutClient`,
`rpc.RPCClient`, and `HTTPClient`, which lives with the inference server and is imported on
first use) and the modules `errors`, `rpc` and `wire`.
"""

from typing import Any

from wtransfer import errors, rpc, wire
from wtransfer.clients import FanoutClient, LocalClient
from wtransfer.fingerprint import fingerprint
from wtransfer.infos import (
    ReceiverInitInfo,
    TrainerInitInfo,
    TransferStats,
    UpdateInfo,
    WireParams,
)
from wtransfer.receiver import ReceiverState, WeightTransferEngine
from wtransfer.registry import (
    Backend,
    BackendInfo,
    create_receiver,
    get_backend,
    list_backends,
    register_backend,
    trainer_init,
)
from wtransfer.sender import TrainerTransferEngine, WeightSyncClient
from wtransfer.source import ModuleSource, WeightSource
from wtransfer.target import ModuleTarget, WeightTarget

__version__ = "0.1.0"

__all__ = [
    "Backend",
    "BackendInfo",
    "FanoutClient",
    "HTTPClient",
    "LocalClient",
    "ModuleSource",
    "ModuleTarget",
    "ReceiverInitInfo",
    "ReceiverState",
    "TrainerInitInfo",
    "TrainerTransferEngine",
    "TransferStats",
    "UpdateInfo",
    "WeightSource",
    "WeightSyncClient",
    "WeightTarget",
    "WeightTransferEngine",
    "WireParams",
    "create_receiver",
    "errors",
    "fingerprint",
    "get_backend",
    "list_backends",
    "register_backend",
    "rpc",
    "trainer_init",
    "wire",
]


def __getattr__(name: str) -> Any:
    """`wtransfer.HTTPClient` speaks the inference server's routes, so it lives in
    `wtransfer.inference.http_client`; import it only when asked for."""
    if name == "HTTPClient":
        from wtransfer.inference.http_client import HTTPClient

        return HTTPClient
    raise AttributeError(f"module 'wtransfer' has no attribute {name!r}")
