"""`ActorClient`: a `WeightSyncClient` (and pause / resume / generate) over an `EngineActor`."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from wtransfer import wire
from wtransfer.control.clients import SingleEngineClient, check_workers
from wtransfer.errors import PeerError, TransferTimeout, reply_result
from wtransfer.inference.outputs import RequestOutput


class ActorClient(SingleEngineClient):
    """Drives one engine actor; every call has a deadline (`timeout_s`). A dead actor is a
    `PeerError` naming it, a call past its deadline a `TransferTimeout`, a failure in the engine the
    matching remote error (`RemoteLifecycleError`, ...), as over RPC or HTTP."""

    def __init__(self, handle: Any, *, timeout_s: float = 60.0, name: str | None = None) -> None:
        import ray

        self._ray = ray
        self.handle = handle
        self.timeout_s = timeout_s
        self.name = name or f"engine actor {handle._actor_id.hex()[:12]}"

    def _get(self, ref: Any, what: str, timeout_s: float | None = None) -> Any:
        exceptions = self._ray.exceptions
        timeout = timeout_s or self.timeout_s
        try:
            return self._ray.get(ref, timeout=timeout)
        except exceptions.GetTimeoutError:
            self._ray.cancel(ref)
            raise TransferTimeout(f"{what} on {self.name} did not answer within "
                                  f"{timeout:g}s") from None
        except exceptions.RayActorError as exc:
            raise PeerError(f"{what}: {self.name} died ({type(exc).__name__}: "
                            f"{str(exc).splitlines()[0]})") from None

    def _result(self, reply_bytes: Any, what: str) -> Any:
        return reply_result(wire.decode(reply_bytes), f"{what} failed on {self.name}")

    def call(self, command: str, *args: Any, timeout_s: float | None = None) -> Any:
        """Run one of `wtransfer.ray.ACTOR_CALLS` on the actor and return its result."""
        ref = self.handle.call.remote(command, wire.encode(list(args)))
        return self._result(self._get(ref, command, timeout_s), command)

    # -- WeightSyncClient ------------------------------------------------------------------

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """Initialize the engine's receiver(s)."""
        self.call("init_weight_transfer_engine", init_info)

    def start_weight_update(self) -> None:
        """Open an update."""
        self.call("start_weight_update")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Deliver one part of the update."""
        self.call("update_weights", update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """Finish the update and label the weights."""
        self.call("finish_weight_update", weight_version)

    def fingerprint(self) -> dict[str, str]:
        """Per-tensor digest of the engine's weights."""
        return dict(self.call("fingerprint"))

    def num_workers(self) -> int:
        """Receiving workers of the engine (its data-parallel ranks)."""
        return check_workers(self, self.call("num_workers"))

    # -- the engine's own calls ------------------------------------------------------------

    def pause(self, mode: str = "abort", clear_cache: bool = True) -> None:
        """Pause generation (`abort`, `wait` or `keep`)."""
        self.call("pause_generation", mode, clear_cache)

    def resume(self) -> None:
        """Resume generation."""
        self.call("resume_generation")

    def weight_version(self) -> str:
        """The engine's weight label."""
        return str(self.call("get_weight_version"))

    def stats(self) -> dict[str, Any]:
        """The engine's counters (running, waiting, ...)."""
        return dict(self.call("stats"))

    def generate_stream(self, prompt_token_ids: list[int],
                        sampling_params: dict[str, Any] | None = None,
                        request_id: str | None = None) -> Iterator[RequestOutput]:
        """Cumulative outputs of one request as the engine produces them; each within the
        client's deadline."""
        stream = self.handle.generate.remote(wire.encode({
            "prompt_token_ids": list(prompt_token_ids),
            "sampling_params": sampling_params or {}, "request_id": request_id}))
        while True:
            ready, _ = self._ray.wait([stream], timeout=self.timeout_s)
            if not ready:
                self._ray.cancel(stream)
                raise TransferTimeout(f"generate on {self.name}: no output within "
                                      f"{self.timeout_s:g}s")
            try:
                ref = next(stream)
            except StopIteration:
                return
            yield RequestOutput.from_wire(self._result(self._get(ref, "generate"), "generate"))

    def generate(self, prompt_token_ids: list[int],
                 sampling_params: dict[str, Any] | None = None,
                 request_id: str | None = None) -> RequestOutput:
        """The final output of one request."""
        last = None
        for output in self.generate_stream(prompt_token_ids, sampling_params, request_id):
            last = output
        if last is None:
            raise PeerError(f"generate: {self.name} ended the stream without an output")
        return last

    def __repr__(self) -> str:
        return f"ActorClient({self.name})"
