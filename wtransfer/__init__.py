"""wtransfer: move model weights from an RL trainer into a serving inference engine.

The public surface: the backend registry (`Backend`, `register_backend`, `get_backend`,
`list_backends`, `create_receiver`, `trainer_init`), the lifecycle ABCs
(`WeightTransferEngine`, `TrainerTransferEngine`, `TransferStats`), sources and targets
(`ModuleSource`, `ModuleTarget`, `fingerprint`), clients (`LocalClient`, `FanoutClient`,
`rpc.RPCClient`) and the modules `errors`, `rpc` and `wire`.
"""

from wtransfer import errors, rpc, wire
from wtransfer.clients import FanoutClient, HTTPClient, LocalClient, WeightSyncClient
from wtransfer.engine import (
    ReceiverInitInfo,
    TrainerInitInfo,
    TrainerTransferEngine,
    TransferStats,
    UpdateInfo,
    WeightTransferEngine,
    WireParams,
)
from wtransfer.fingerprint import fingerprint
from wtransfer.registry import (
    Backend,
    BackendInfo,
    create_receiver,
    get_backend,
    list_backends,
    register_backend,
    trainer_init,
)
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
