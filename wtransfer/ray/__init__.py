"""wtransfer on Ray: engine actors, a `WeightSyncClient` over actor calls, and placement.

    import ray
    from wtransfer.ray import LOCAL_RAY, start_engines, trainer_init_info

    ray.init(_system_config=LOCAL_RAY)              # or ray.init(address="auto") on a cluster
    engines = start_engines(2, {"model": "tiny", "weight_transfer_backend": "nccl"})
    client = FanoutClient(engines.clients())
    info = trainer_init_info("nccl", client, bucket_bytes=64 << 20)
    with wtransfer.trainer_init(info, client=client, source=ModuleSource(model)) as sender:
        sender.send_weights(weight_version="step-1")
    engines.close()

Needs the `ray` extra (from the clone: ``pip install -e '.[ray]'``). Every record crossing an
actor call is msgpack bytes (`wtransfer.wire`), never a pickled object of ours.
"""

from wtransfer.ray.actor import ACTOR_CALLS, LOCAL_RAY, EngineActor
from wtransfer.ray.client import ActorClient
from wtransfer.ray.placement import (
    EngineGroup,
    start_engines,
    trainer_address,
    trainer_init_info,
)

__all__ = ["ACTOR_CALLS", "LOCAL_RAY", "ActorClient", "EngineActor", "EngineGroup",
           "start_engines", "trainer_address", "trainer_init_info"]
