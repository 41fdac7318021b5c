"""The demo's policy served by engine actors on a Ray cluster (`wtransfer demo --ray`).

Same surface as the other policy servers (`client`, `generate`, `stream`, `pause`, `resume`,
`weight_version`, `reference`, `inflight`, `close`): requests go round-robin to N
`EngineActor`s, and every pause, update and resume reaches all of them.
"""

from __future__ import annotations

import itertools
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from wtransfer.control.clients import FanoutClient
from wtransfer.demos.rl.servers import FreshEngineReference, Stream
from wtransfer.protocol import WeightSyncClient

CALL_TIMEOUT_S = 600.0


class RayPolicyServer:
    """N engine actors placed by Ray (a local cluster unless `address` names one)."""

    def __init__(self, *, model: str, seed: int, backend: str, engines: int = 2,
                 address: str | None = None) -> None:
        import ray

        from wtransfer.ray import LOCAL_RAY, start_engines

        self.model = model
        self._started_ray = not ray.is_initialized()
        if self._started_ray:
            ray.init(address=address, include_dashboard=False, log_to_driver=False,
                     _system_config=None if address else LOCAL_RAY)  # a cluster has its own
        self.engines = start_engines(engines, {
            "model": model, "seed": seed, "batch_invariant": True, "max_num_seqs": 256,
            "weight_transfer_backend": backend})
        self.actors = self.engines.clients(timeout_s=CALL_TIMEOUT_S)
        self.client: WeightSyncClient = (self.actors[0] if engines == 1
                                         else FanoutClient(self.actors))
        self._next = itertools.cycle(self.actors)
        self._pool = ThreadPoolExecutor(max_workers=128, thread_name_prefix="rollout")
        self._fan = ThreadPoolExecutor(max_workers=engines, thread_name_prefix="ray-fan")

    def _all(self, call: Any) -> list[Any]:
        return [f.result(timeout=CALL_TIMEOUT_S)
                for f in [self._fan.submit(call, a) for a in self.actors]]

    def _run(self, prompt: list[int], params: dict[str, Any],
             handle: Stream | None = None) -> dict[str, Any]:
        last = None
        for last in next(self._next).generate_stream(prompt, params):
            if handle is not None:
                handle.tokens = len(last.outputs[0].token_ids)
        assert last is not None
        return last.outputs[0].to_wire()

    def generate(self, prompts: list[list[int]], params: dict[str, Any]
                 ) -> list[Future[dict[str, Any]]]:
        """Submit every prompt at once, spread over the engines."""
        return [self._pool.submit(self._run, p, params) for p in prompts]

    def stream(self, prompt: list[int], params: dict[str, Any]) -> Stream:
        """Submit one request whose progress is visible."""
        handle = Stream()
        return handle.follow(self._pool.submit(self._run, prompt, params, handle))

    staging = "off"
    """These engines land updates in place: the demo pauses around them."""

    def stall_ms(self) -> float | None:
        """Not measured for this engine."""
        return None

    def pause(self, mode: str, clear_cache: bool) -> None:
        """Pause every engine."""
        self._all(lambda a: a.pause(mode, clear_cache))

    def resume(self) -> None:
        """Resume every engine."""
        self._all(lambda a: a.resume())

    def weight_version(self) -> str:
        """The weight label, which every engine must share."""
        versions = set(self._all(lambda a: a.weight_version()))
        if len(versions) != 1:
            raise RuntimeError(f"engines hold different weight versions: {sorted(versions)}")
        return versions.pop()

    def reference(self, state: dict[str, torch.Tensor]) -> FreshEngineReference:
        """Greedy continuations from a fresh engine holding the weights `state`."""
        return FreshEngineReference(self.model, state)

    def inflight(self) -> int:
        """Requests running or waiting in all engines."""
        return sum(int(s["running"] + s["waiting"]) for s in self._all(lambda a: a.stats()))

    def close(self) -> None:
        """Stop the engines (and the local cluster this server started)."""
        import ray

        self._pool.shutdown(wait=False, cancel_futures=True)
        self._fan.shutdown(wait=False)
        self.engines.close()
        if self._started_ray:
            ray.shutdown()
