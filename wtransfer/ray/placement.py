"""Placing engine actors on a Ray cluster, and the trainer's address as Ray sees it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Literal

from wtransfer import wire
from wtransfer.errors import ConfigError, TransferTimeout
from wtransfer.protocol import WeightSyncClient
from wtransfer.ray.actor import EngineActor
from wtransfer.ray.client import ActorClient
from wtransfer.registry import get_backend

Strategy = Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"]


class EngineGroup:
    """Engine actors placed together in one placement group; iterate it for their handles.
    `close()` (or leaving a `with` block) stops them and frees the group's resources."""

    def __init__(self, handles: list[Any], group: Any) -> None:
        self.handles = handles
        self.placement_group = group

    def clients(self, *, timeout_s: float = 60.0) -> list[ActorClient]:
        """One `ActorClient` per engine, named by its index."""
        return [ActorClient(h, timeout_s=timeout_s, name=f"engine actor {i}")
                for i, h in enumerate(self.handles)]

    def __iter__(self) -> Iterator[Any]:
        return iter(self.handles)

    def __len__(self) -> int:
        return len(self.handles)

    def __getitem__(self, index: int) -> Any:
        return self.handles[index]

    def close(self) -> None:
        """Kill every engine actor and remove the placement group; idempotent."""
        import ray

        handles, self.handles = self.handles, []
        for handle in handles:
            with contextlib.suppress(Exception):
                ray.kill(handle, no_restart=True)
        group, self.placement_group = self.placement_group, None
        if group is not None:
            with contextlib.suppress(Exception):
                ray.util.remove_placement_group(group)

    def __enter__(self) -> EngineGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def start_engines(count: int, config: dict[str, Any], *, gpus_per_engine: float | None = None,
                  cpus_per_engine: float = 1, strategy: Strategy = "SPREAD",
                  timeout_s: float = 300.0) -> EngineGroup:
    """Start `count` `EngineActor`s (`config`: `EngineConfig` fields) in one placement group, a
    bundle each, and return them once all are up. `gpus_per_engine` defaults to one per
    data-parallel rank on CUDA, else none. `TransferTimeout` past `timeout_s`; `ConfigError`
    (with the engine's own error) when the cluster cannot place them or one fails to start."""
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    if count < 1:
        raise ConfigError(f"count must be >= 1, got {count}")
    ranks = int(config.get("data_parallel_size", 1))
    cuda = str(config.get("device", "cpu")).startswith("cuda")
    gpus = float(ranks if cuda else 0) if gpus_per_engine is None else gpus_per_engine
    if cuda and not gpus:
        raise ConfigError("a CUDA engine needs gpus_per_engine > 0")
    bundle: dict[str, float] = {"CPU": cpus_per_engine, **({"GPU": gpus} if gpus else {})}
    engines = EngineGroup([], placement_group([bundle] * count, strategy=strategy))
    try:
        ready, _ = ray.wait([engines.placement_group.ready()], timeout=timeout_s)
        if not ready:
            raise ConfigError(f"the cluster could not place {count} engine(s) of {bundle} "
                              f"within {timeout_s:g}s ({ray.available_resources()} available)")
        actor: Any = ray.remote(EngineActor)
        payload = wire.encode({**config, **({"device": "cuda"} if cuda else {})})
        engines.handles = [actor.options(
            num_cpus=cpus_per_engine, num_gpus=gpus,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=engines.placement_group, placement_group_bundle_index=i)
        ).remote(payload) for i in range(count)]
        for i, handle in enumerate(engines.handles):  # one that cannot start says so here
            try:
                ray.get(handle.node_address.remote(), timeout=timeout_s)
            except ray.exceptions.GetTimeoutError:
                raise TransferTimeout(f"engine actor {i} did not start within "
                                      f"{timeout_s:g}s") from None
            except ray.exceptions.RayActorError as exc:
                raise ConfigError(f"engine actor {i} failed to start: "
                                  f"{str(exc).strip().splitlines()[-1]}") from None
    except BaseException:
        engines.close()
        raise
    return engines


def trainer_address() -> str:
    """This process's node address as Ray sees it (where engines on other nodes reach it)."""
    import ray

    return str(ray.util.get_node_ip_address())


def trainer_init_info(backend: str, client: WeightSyncClient, **fields: Any) -> Any:
    """The trainer init info of `backend` with the addresses filled in from Ray: nccl's
    `master_address` (and `world_size`: this sender plus every worker behind `client`), ucx's
    `listen_address`. Fields you pass win."""
    cls = get_backend(backend).sender_class().init_info_cls
    if backend == "nccl":
        fields = {"master_address": trainer_address(),
                  "world_size": 1 + client.num_workers(), **fields}
    elif backend == "ucx":
        fields = {"listen_address": trainer_address(), **fields}
    return cls(**fields)
