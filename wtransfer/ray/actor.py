"""`EngineActor`: an `AsyncEngine` hosted in a Ray actor.

The actor is asynchronous: the engine's asyncio face runs on the actor's event loop, so
generate streams, pauses and weight updates interleave exactly as they do behind `wtransfer
serve` (a keep-mode update lands while requests are in flight). Calls and replies are msgpack
bytes; a failure comes back as an error reply that `ActorClient` turns into the matching
exception.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from wtransfer import wire
from wtransfer.errors import ConfigError, error_reply, ok_reply
from wtransfer.inference.async_engine import AsyncEngine
from wtransfer.inference.config import EngineConfig
from wtransfer.inference.params import SamplingParams


async def _num_workers(engine: AsyncEngine) -> int:
    return engine.num_workers()


ACTOR_CALLS: dict[str, Callable[..., Awaitable[Any]]] = {
    "init_weight_transfer_engine": AsyncEngine.init_weight_transfer_engine,
    "start_weight_update": AsyncEngine.start_weight_update,
    "update_weights": AsyncEngine.update_weights,
    "finish_weight_update": AsyncEngine.finish_weight_update,
    "fingerprint": AsyncEngine.fingerprint,
    "num_workers": _num_workers,
    "pause_generation": AsyncEngine.pause_generation,
    "resume_generation": AsyncEngine.resume_generation,
    "is_paused": AsyncEngine.is_paused,
    "get_weight_version": AsyncEngine.get_weight_version,
    "weight_info": AsyncEngine.weight_info,
    "stats": AsyncEngine.stats,
}
"""What `EngineActor.call` serves: the weight-sync calls plus pause, resume and status."""


LOCAL_RAY: dict[str, Any] = {"worker_niceness": 0}
"""Ray settings for an instance started to host engines: ``ray.init(_system_config=
LOCAL_RAY)``. Ray starts worker processes at niceness 15 by default, so an engine actor
imports and builds its model at the lowest priority of a busy node (on 2 cores beside two
busy processes, actors took minutes to start); at 0 they start as any process does. An
existing cluster takes the same setting where it starts (``RAY_worker_niceness=0``)."""


def undo_worker_niceness() -> int:
    """Bring every thread of this process back to niceness 0 and return the niceness it had (Ray
    starts workers at 15, which starves an engine on a busy node: docs/ray.md). Needs root or
    CAP_SYS_NICE; without it a warning names the Ray setting to change instead."""
    before = os.getpriority(os.PRIO_PROCESS, 0)
    if before <= 0:
        return before
    try:
        threads = [int(tid) for tid in os.listdir("/proc/self/task")]
    except FileNotFoundError:  # no /proc: one niceness for the whole process
        threads = [0]
    try:
        for tid in threads:
            with contextlib.suppress(ProcessLookupError):  # a thread that just ended
                os.setpriority(os.PRIO_PROCESS, tid, 0)
    except PermissionError:
        warnings.warn(f"this engine actor runs at niceness {before} (Ray's worker_niceness) "
                      "and may not lower it: a busy node will starve it; start Ray with "
                      "_system_config={'worker_niceness': 0} (or RAY_worker_niceness=0 "
                      "where the cluster starts)", RuntimeWarning, stacklevel=2)
    return before


class EngineActor:
    """Hosts one `AsyncEngine` (every data-parallel rank of it) in a Ray actor. Create it with
    `start_engines` (or ``ray.remote(EngineActor).remote(config_bytes)``, an `EngineConfig` as
    msgpack bytes of its fields); it first leaves Ray's low priority (`undo_worker_niceness`)."""

    def __init__(self, config: bytes) -> None:
        fields = wire.decode(config)
        if not isinstance(fields, dict):
            raise ConfigError("EngineActor takes an EngineConfig's fields as msgpack bytes")
        undo_worker_niceness()
        self.engine = AsyncEngine(EngineConfig(**fields))

    async def call(self, command: str, args: bytes) -> bytes:
        """Run `command` (one of `ACTOR_CALLS`) with the positional `args` (msgpack list);
        the reply is ``{"ok": true, "result": ...}`` or an error reply, as msgpack."""
        try:
            method = ACTOR_CALLS.get(command)
            if method is None:
                raise ConfigError(f"unknown engine actor call {command!r}; known: "
                                  f"{sorted(ACTOR_CALLS)}")
            values = wire.decode(args)
            if not isinstance(values, list):
                raise ConfigError(f"{command}: arguments must be a msgpack list")
            result = await method(self.engine, *values)
        except Exception as exc:
            return wire.encode(error_reply(exc))
        return wire.encode(ok_reply(result))

    async def generate(self, request: bytes) -> AsyncIterator[bytes]:
        """Stream one request's cumulative outputs (`RequestOutput.to_wire()`, msgpack);
        `request` holds ``prompt_token_ids``, ``sampling_params`` and optional
        ``request_id``. A refused request yields one error reply. Stopping the stream
        early aborts the request."""
        try:
            fields = wire.decode(request)
            if not isinstance(fields, dict):
                raise ConfigError("generate takes a msgpack map")
            params = SamplingParams(**dict(fields.get("sampling_params") or {}))
            stream = self.engine.generate(list(fields["prompt_token_ids"]), params,
                                          fields.get("request_id"))
            async for output in stream:
                yield wire.encode(ok_reply(output.to_wire()))
        except Exception as exc:
            yield wire.encode(error_reply(exc))

    def niceness(self) -> int:
        """This actor's niceness now (0 once `undo_worker_niceness` could reset it)."""
        return os.getpriority(os.PRIO_PROCESS, 0)

    def node_address(self) -> str:
        """The address of this actor's node as Ray sees it."""
        import ray

        return str(ray.util.get_node_ip_address())

    def shutdown(self) -> None:
        """Stop the engine (abort live requests, release the receiver)."""
        self.engine.shutdown()
