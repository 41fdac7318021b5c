"""The trainer's control plane: how a sender drives one or many receivers.

Every client speaks the `WeightSyncClient` protocol. `LocalClient` calls an engine in the same
process; `wtransfer.rpc.RPCClient` reaches a receiver in another process; `FanoutClient` sends
each call to several instances at once (engines behind an external load balancer).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol, TypeVar, runtime_checkable

from wtransfer.engine import WeightTransferEngine
from wtransfer.errors import ConfigError, IntegrityError, PeerError, TransferTimeout

T = TypeVar("T")


@runtime_checkable
class WeightSyncClient(Protocol):
    """The five calls a sender makes on whatever holds the receiving engine."""

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """Initialize the receiver with the sender's init info."""

    def start_weight_update(self) -> None:
        """Open an update."""

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Deliver one part of the update; returns once the receiver consumed it."""

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """Close the update and label the weights with `weight_version`."""

    def fingerprint(self) -> dict[str, str]:
        """Per-tensor digest of what the engine holds now."""


def workers_behind(client: object) -> int:
    """How many receiving workers one client drives: its `num_workers` (an engine with data
    parallelism has one per rank), else 1. Senders size NCCL groups and UCX endpoint counts
    by it."""
    count = getattr(client, "num_workers", 1)
    if not isinstance(count, int) or count < 1:
        raise ConfigError(f"{client!r} reports num_workers={count!r}; expected an int >= 1")
    return count


def worker_counts(client: object) -> list[int]:
    """`workers_behind` of each client of a `FanoutClient`, or of the one client."""
    clients = client.clients if isinstance(client, FanoutClient) else [client]
    return [workers_behind(c) for c in clients]


class LocalClient:
    """Drives a `WeightTransferEngine` living in this process (no serialization)."""

    def __init__(self, engine: WeightTransferEngine[Any, Any]) -> None:
        self.engine = engine
        self.weight_version: str | None = None
        """Label given by the last successful `finish_weight_update`."""

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """Initialize the engine."""
        self.engine.init_transfer_engine(init_info)

    def start_weight_update(self) -> None:
        """Open an update on the engine."""
        self.engine.start_weight_update()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Deliver one part of the update."""
        self.engine.update_weights(update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """Finish the update and record `weight_version`."""
        self.engine.finish_weight_update()
        if weight_version is not None:
            self.weight_version = weight_version

    def fingerprint(self) -> dict[str, str]:
        """Digest of the engine's target."""
        return self.engine.target.fingerprint()


class HTTPClient:
    """A `WeightSyncClient` (plus pause/resume/version calls) for a `wtransfer serve` server.

    Init and update infos travel as msgpack (they may hold bytes such as IPC handles); every
    other body is JSON. Error replies become `PeerError` carrying the server's error type; a
    request past `timeout` becomes `TransferTimeout`.
    """

    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 60.0) -> None:
        import httpx

        self.base_url = base_url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout)
        self.timeout = timeout

    def _request(self, method: str, path: str, *, json_body: Any = None, packed: Any = None,
                 params: dict[str, str] | None = None) -> Any:
        import httpx

        from wtransfer import wire

        kwargs: dict[str, Any] = {"params": params}
        if packed is not None:
            kwargs.update(content=wire.encode(packed),
                          headers={"Content-Type": "application/msgpack"})
        elif json_body is not None:
            kwargs["json"] = json_body
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.TimeoutException:
            raise TransferTimeout(f"{method} {self.base_url}{path}: no answer within "
                                  f"{self.timeout:g}s") from None
        except httpx.TransportError as exc:
            raise PeerError(f"{method} {self.base_url}{path}: cannot reach the server: "
                            f"{exc}") from None
        if response.status_code >= 400:
            try:
                detail = response.json()
            except ValueError:
                detail = {"error": "HTTPError", "message": response.text[:500]}
            kind = str(detail.get("error", "HTTPError"))
            raise PeerError(f"{method} {path} -> {response.status_code} {kind}: "
                            f"{detail.get('message', detail)}", remote_type=kind)
        return response.json()

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """POST /init_weight_transfer_engine."""
        self._request("POST", "/init_weight_transfer_engine", packed={"init_info": init_info})

    def start_weight_update(self) -> None:
        """POST /start_weight_update."""
        self._request("POST", "/start_weight_update")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """POST /update_weights (msgpack body)."""
        self._request("POST", "/update_weights", packed={"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """POST /finish_weight_update."""
        self._request("POST", "/finish_weight_update", json_body={"weight_version": weight_version})

    def fingerprint(self) -> dict[str, str]:
        """GET /weight_fingerprint."""
        return dict(self._request("GET", "/weight_fingerprint")["fingerprint"])

    def pause(self, mode: str = "abort", clear_cache: bool = True) -> None:
        """POST /pause."""
        self._request("POST", "/pause", params={"mode": mode,
                                                "clear_cache": str(clear_cache).lower()})

    def resume(self) -> None:
        """POST /resume."""
        self._request("POST", "/resume")

    def is_paused(self) -> bool:
        """GET /is_paused."""
        return bool(self._request("GET", "/is_paused")["is_paused"])

    def update_weight_version(self, new_version: str) -> None:
        """POST /update_weight_version."""
        self._request("POST", "/update_weight_version", json_body={"new_version": new_version})

    def get_weight_version(self) -> str:
        """GET /weight_info."""
        return str(self._request("GET", "/weight_info")["weight_version"])

    @property
    def num_workers(self) -> int:
        """Receiving workers behind the server (its data-parallel ranks), from /weight_info."""
        return int(self._request("GET", "/weight_info").get("num_workers", 1))

    def generate(self, token_ids: list[int], **sampling: Any) -> dict[str, Any]:
        """POST /inference/v1/generate (non-streaming); returns the response body."""
        return dict(self._request("POST", "/inference/v1/generate",
                                  json_body={"token_ids": token_ids,
                                             "sampling_params": sampling}))

    def close(self) -> None:
        """Close the connection pool."""
        self._http.close()

    def __repr__(self) -> str:
        return f"HTTPClient({self.base_url!r})"


class FanoutClient:
    """Sends every call to each client concurrently; a failure names the instance.

    Used for independent engines behind an external load balancer: each instance receives the
    same weights. `fingerprint()` returns the common digest and raises `IntegrityError` when the
    instances disagree.
    """

    def __init__(self, clients: Sequence[WeightSyncClient]) -> None:
        if not clients:
            raise ConfigError("FanoutClient needs at least one client")
        self.clients = list(clients)
        self._pool = ThreadPoolExecutor(max_workers=len(self.clients),
                                        thread_name_prefix="wtransfer-fanout")

    def map(self, call: Callable[[WeightSyncClient, int], T]) -> list[T]:
        """Run `call(client, index)` on every client at once; raise on any failure."""
        futures = [self._pool.submit(call, c, i) for i, c in enumerate(self.clients)]
        results: list[T] = []
        failures: list[tuple[int, BaseException]] = []
        for i, fut in enumerate(futures):
            try:
                results.append(fut.result())
            except Exception as exc:
                failures.append((i, exc))
        if failures:
            i, first = failures[0]
            where = ", ".join(f"#{j} ({self.clients[j]!r})" for j, _ in failures)
            message = f"{len(failures)} of {len(self.clients)} instance(s) failed: {where}; " \
                      f"first error: {type(first).__name__}: {first}"
            if isinstance(first, TransferTimeout):
                raise TransferTimeout(message) from first
            raise PeerError(message, remote_type=type(first).__name__) from first
        return results

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """Initialize every instance with the same init info."""
        self.map(lambda c, _: c.init_weight_transfer_engine(init_info))

    def start_weight_update(self) -> None:
        """Open an update on every instance."""
        self.map(lambda c, _: c.start_weight_update())

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Deliver the same update part to every instance."""
        self.map(lambda c, _: c.update_weights(update_info))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """Finish on every instance with the same version label."""
        self.map(lambda c, _: c.finish_weight_update(weight_version))

    def fingerprint(self) -> dict[str, str]:
        """The digest all instances agree on; `IntegrityError` naming those that differ."""
        prints = self.map(lambda c, _: c.fingerprint())
        odd = [i for i, p in enumerate(prints) if p != prints[0]]
        if odd:
            raise IntegrityError(f"instances {odd} hold different weights from instance 0")
        return prints[0]

    def close(self) -> None:
        """Stop the worker threads."""
        self._pool.shutdown(wait=False)

    def __repr__(self) -> str:
        return f"FanoutClient({self.clients!r})"
