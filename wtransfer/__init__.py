"""wtransfer: move model weights from an RL trainer into a serving inference engine.

The public surface: the backend registry (`Backend`, `register_backend`, `get_backend`,
`list_backends`, `create_receiver`, `trainer_init`), the lifecycle ABCs
(`WeightTransferEngine`, `TrainerTransferEngine`, `TransferStats`), sources and targets
(`ModuleSource`, `ModuleTarget`, `fingerprint`), clients (`LocalClient`, `FanoutClient`,
`HTTPClient`, `rpc.RPCClient`) and the modules `errors`, `rpc` and `wire`.
"""

import sys

from wtransfer import errors, moved, wire
from wtransfer.control import rpc
from wtransfer.control.clients import FanoutClient, HTTPClient, LocalClient
from wtransfer.fingerprint import fingerprint
from wtransfer.protocol import WeightSyncClient
from wtransfer.receiver.engine import ReceiverState, WeightTransferEngine
from wtransfer.receiver.target import ModuleTarget, WeightTarget
from wtransfer.records import (
    Capabilities,
    ReceiverInitInfo,
    TrainerInitInfo,
    TransferStats,
    UpdateInfo,
    WireParams,
)
from wtransfer.registry import (
    Backend,
    BackendInfo,
    create_receiver,
    get_backend,
    list_backends,
    register_backend,
    trainer_init,
)
from wtransfer.trainer.engine import TrainerTransferEngine
from wtransfer.trainer.source import ModuleSource, WeightSource

moved.install("wtransfer", {"channel": "transport.channel", "stacks": "transport.stacks",
                            "device_kernels": "transport.device_kernels",
                            "clients": "control.clients"})
sys.modules.setdefault("wtransfer.rpc", rpc)  # (a public module name: `import wtransfer.rpc`)

__version__ = "0.1.0"

__all__ = [
    "Backend",
    "BackendInfo",
    "Capabilities",
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

