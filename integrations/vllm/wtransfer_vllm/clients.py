"""Trainer-side `WeightSyncClient`s that drive a real vLLM engine.

`AsyncLLMClient` calls an in-process `AsyncLLM` from the trainer's thread while the engine's
event loop runs elsewhere; `ServerClient` speaks ``vllm serve``'s weight-transfer routes
(``VLLM_SERVER_DEV_MODE=1``). Records travel as plain dicts in process and as msgpack inside
one JSON field over HTTP (`envelope`): never pickle. Fingerprints and worker states are read
through vLLM's ``collective_rpc`` from the `WorkerExtension` methods, so start vLLM with
``worker_extension_cls=wtransfer_vllm.WORKER_EXTENSION`` (see `engine_kwargs`).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, TypeVar

from wtransfer.control.clients import HTTPClient, SingleEngineClient, check_workers
from wtransfer.errors import (
    ConfigError,
    IntegrityError,
    LifecycleError,
    PeerError,
    TransferTimeout,
    WTransferError,
    relayed_kind,
    remote_error,
)
from wtransfer_vllm.envelope import wrap
from wtransfer_vllm.names import (
    FINGERPRINT_METHOD,
    ROLLBACK_METHOD,
    STATE_METHOD,
    WORKER_EXTENSION,
)

T = TypeVar("T")


def agree(per_worker: list[dict[str, str]]) -> dict[str, str]:
    """The fingerprint of what the workers hold together: every tensor (or kept part of one,
    `wtransfer.fingerprint.part_name`) as the workers holding it report it; where several
    report the same one they must agree (`IntegrityError` naming the worker that differs).
    Workers keeping different parts, or different experts, report different keys."""
    if not per_worker:
        raise PeerError("vLLM returned no worker fingerprints")
    out: dict[str, str] = {}
    holder: dict[str, int] = {}
    for index, reported in enumerate(per_worker):
        for key, digest in reported.items():
            if out.setdefault(key, digest) != digest:
                raise IntegrityError(f"vLLM worker {index} holds {key} differently from "
                                     f"worker {holder[key]}")
            holder.setdefault(key, index)
    return out


LOADED_POLL_S = 0.005
"""How often a client asks whether the workers' shadows are loaded, before a finish."""


def wait_loaded(states: Callable[[], list[dict[str, Any]]], timeout_s: float) -> bool:
    """Before a staged engine's finish: wait until no worker is still loading the update
    into its shadow (each poll is a short call between two of vLLM's steps, where a finish
    would hold the steps for the whole wait). False for an engine that is not staged (or
    that cannot say: started without the worker extension); `TransferTimeout` past
    `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            now = states()
        except ConfigError:
            return False
        if not any(s.get("staging", "off") != "off" for s in now):
            return False
        if not any(s.get("loading") for s in now):
            return True
        if time.monotonic() > deadline:
            raise TransferTimeout(f"the vLLM workers were still loading the update into their "
                                  f"shadows after {timeout_s:g}s")
        time.sleep(LOADED_POLL_S)


def _no_extension(exc: BaseException) -> bool:
    return FINGERPRINT_METHOD in str(exc) or STATE_METHOD in str(exc)


class AsyncLLMClient(SingleEngineClient):
    """A `WeightSyncClient` over an in-process vLLM `AsyncLLM`.

    Build it on the engine's event loop (or pass `loop`), then call it from another thread
    (e.g. ``await asyncio.to_thread(sender.send_weights)``): each call runs on the engine's
    loop and waits at most `timeout_s`.
    """

    def __init__(self, engine: Any, *, loop: asyncio.AbstractEventLoop | None = None,
                 timeout_s: float = 600.0) -> None:
        self.engine = engine
        self.loop = loop or asyncio.get_running_loop()
        self.timeout_s = timeout_s
        self._labels: tuple[str | None, str | None] = (None, None)
        """The weight version before the last update this client finished, and its own."""
        self._staged: bool | None = None
        """Whether the engine stages updates into shadows (asked at the first finish)."""

    def _run(self, what: str, make: Callable[[], Awaitable[T]]) -> T:
        if threading.get_ident() == getattr(self.loop, "_thread_id", None):
            raise LifecycleError(f"AsyncLLMClient.{what} was called on the engine's own event "
                                 "loop, which it would block; call it from another thread "
                                 "(asyncio.to_thread)")

        async def call() -> T:
            return await make()

        future = asyncio.run_coroutine_threadsafe(call(), self.loop)
        try:
            return future.result(timeout=self.timeout_s)
        except FutureTimeout:
            future.cancel()
            raise TransferTimeout(f"vLLM {what} did not complete within "
                                  f"{self.timeout_s:g}s") from None
        except WTransferError:
            raise
        except Exception as exc:  # a worker's wtransfer error arrives as text: keep its kind
            raise remote_error(f"vLLM {what} failed: {type(exc).__name__}: {exc}",
                               relayed_kind(str(exc)) or type(exc).__name__) from exc

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """Initialize every worker's wtransfer engine."""
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        self._run("init_weight_transfer_engine", lambda: self.engine.init_weight_transfer_engine(
            WeightTransferInitRequest(init_info=init_info)))

    def start_weight_update(self) -> None:
        """Open an update on every worker."""
        self._run("start_weight_update", self.engine.start_weight_update)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Deliver one part of the update to every worker."""
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        self._run("update_weights", lambda: self.engine.update_weights(
            WeightTransferUpdateRequest(update_info=update_info)))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """Finish on every worker and label the weights."""
        before = self._labels[1]
        if before is None:
            before = str(self._run("get_weight_version", self.engine.get_weight_version))
        self.wait_staged(self.timeout_s)
        self._run("finish_weight_update",
                  lambda: self.engine.finish_weight_update(weight_version=weight_version))
        self._labels = (before, weight_version if weight_version is not None else before)

    def wait_staged(self, timeout_s: float) -> None:
        """Return once no worker is still loading the open update into its shadow (a
        `StagingClient`: vLLM runs a finish on its engine core, so a finish that waited there
        would hold generation)."""
        if self._staged is not False:
            self._staged = wait_loaded(self.worker_states, timeout_s)

    def rollback_weights(self) -> str:
        """Make the version before the last update live again on every worker of a staged
        engine (a swap back: the shadow still holds it) and restore its label; returns the
        label. `LifecycleError` where the previous version is no longer resident."""
        previous = self._labels[0]
        self._collective(ROLLBACK_METHOD)
        if previous is not None:
            self._run("update_weight_version",
                      lambda: self.engine.update_weight_version(previous))
        self._labels = (None, previous)
        return str(previous)

    def pause(self, mode: str = "abort", clear_cache: bool = True) -> None:
        """Pause vLLM's generation (`abort`, `wait` or `keep` the requests in flight)."""
        self._run("pause_generation", lambda: self.engine.pause_generation(
            mode=mode, clear_cache=clear_cache))

    def resume(self) -> None:
        """Resume vLLM's generation."""
        self._run("resume_generation", self.engine.resume_generation)

    def num_workers(self) -> int:
        """vLLM workers of every data-parallel replica (tensor x pipeline parallel each)."""
        parallel = self.engine.vllm_config.parallel_config
        return check_workers(self, parallel.world_size * parallel.data_parallel_size)

    def fingerprint(self) -> dict[str, str]:
        """Per-tensor digest, by checkpoint name, of what every worker holds (they agree)."""
        return agree(self._collective(FINGERPRINT_METHOD))

    def worker_states(self) -> list[dict[str, Any]]:
        """Each worker's receiver state (state, torn, failure)."""
        return self._collective(STATE_METHOD)

    def _collective(self, method: str) -> Any:
        try:
            return self._run(method, lambda: self.engine.collective_rpc(method))
        except PeerError as exc:
            if _no_extension(exc):
                raise ConfigError(f"start vLLM with worker_extension_cls={WORKER_EXTENSION!r} "
                                  f"to read fingerprints ({exc})") from None
            raise

    def __repr__(self) -> str:
        return "AsyncLLMClient()"


class ServerClient(HTTPClient):
    """A `WeightSyncClient` (plus pause/resume/versions) for ``vllm serve`` started with
    ``VLLM_SERVER_DEV_MODE=1``, ``--weight-transfer-config '{"backend": "wtransfer-<name>"}'``
    and ``--worker-extension-cls wtransfer_vllm.worker.WorkerExtension``.

    LoRA adapters sent in memory (`wtransfer.trainer.lora.LoRASource`): after the update that
    brought a new adapter lands, the client names it to the server's model list (its
    ``/v1/load_lora_adapter`` route, path ``wtransfer://<name>``: the worker builds it from the
    received tensors), so requests name it as their ``model`` (`generate(..., lora=name)`).
    That route needs ``--enable-lora`` and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._listed: set[str] = set()
        """Adapters the server's model list knows."""
        self._staged: bool | None = None
        """Whether the engine stages updates into shadows (asked at the first finish)."""
        self._arriving: set[str] = set()
        """Adapters the open update carries that the list does not know yet."""

    def can_batch(self, method: str) -> bool:
        """Never: ``vllm serve`` has no route that carries several calls (each goes alone)."""
        return False

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """POST /init_weight_transfer_engine (the record as msgpack in one JSON field)."""
        self._request("POST", "/init_weight_transfer_engine",
                      json_body={"init_info": wrap(init_info)})

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """POST /update_weights (the record as msgpack in one JSON field); notes the adapters
        its tensor list names."""
        for entry in update_info.get("tensors") or ():
            name = entry[0] if isinstance(entry, list | tuple) and entry else None
            if isinstance(name, str) and name.startswith("lora/"):
                adapter = name.split("/", 2)[1]
                if adapter not in self._listed:
                    self._arriving.add(adapter)
        self._request("POST", "/update_weights", json_body={"update_info": wrap(update_info)})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """POST /finish_weight_update (once a staged engine's shadows are loaded); then name
        each new adapter of the update to the server's model list."""
        try:
            self.wait_staged(self.timeout_s)
            super().finish_weight_update(weight_version)
        except BaseException:
            self._arriving = set()
            raise
        arriving, self._arriving = sorted(self._arriving), set()
        for adapter in arriving:
            self.list_adapter(adapter)

    def wait_staged(self, timeout_s: float) -> None:
        """As `AsyncLLMClient.wait_staged`."""
        if self._staged is not False:
            self._staged = wait_loaded(self.worker_states, timeout_s)

    def list_adapter(self, name: str) -> None:
        """Name in-memory adapter `name` to the server's model list (once; the update that
        carried it must have landed)."""
        try:
            self._request("POST", "/v1/load_lora_adapter", json_body={
                "lora_name": name, "lora_path": f"wtransfer://{name}"})
        except WTransferError as exc:
            text = str(exc)
            if "has already been loaded" not in text:
                if "404" in text or "Not Found" in text:
                    raise ConfigError(f"adapter {name!r} landed, but vllm serve cannot list it: "
                                      "start it with --enable-lora and "
                                      "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1") from None
                raise
        self._listed.add(name)

    def generate(self, token_ids: list[int], *, lora: str | None = None,
                 **sampling: Any) -> dict[str, Any]:
        """POST /inference/v1/generate (non-streaming), with adapter `lora` (its name as the
        request's model) or the base model."""
        body: dict[str, Any] = {"token_ids": token_ids, "sampling_params": sampling}
        if lora is not None:
            body["model"] = lora
        return dict(self._request("POST", "/inference/v1/generate", json_body=body))

    def num_workers(self) -> int:
        """GET /get_world_size: vLLM workers across data-parallel replicas."""
        return check_workers(self, self._request("GET", "/get_world_size")["world_size"])

    def fingerprint(self) -> dict[str, str]:
        """POST /collective_rpc wtransfer_fingerprint: what every worker holds."""
        return agree(self._collective(FINGERPRINT_METHOD))

    def worker_states(self) -> list[dict[str, Any]]:
        """Each worker's receiver state."""
        return list(self._collective(STATE_METHOD))

    def _collective(self, method: str) -> Any:
        try:
            return self._request("POST", "/collective_rpc", json_body={"method": method})[
                "results"]
        except PeerError as exc:
            if _no_extension(exc):
                raise ConfigError(f"start vllm serve with --worker-extension-cls "
                                  f"{WORKER_EXTENSION} to read fingerprints ({exc})") from None
            raise

    def __repr__(self) -> str:
        return f"ServerClient({self.base_url!r})"
