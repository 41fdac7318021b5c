"""Control-plane clients: how a sender reaches one or many receiving engines.

Every client speaks `wtransfer.protocol.WeightSyncClient`. `LocalClient` calls an engine in
the same process; `wtransfer.rpc.RPCClient` reaches a receiver in another process;
`HTTPClient` speaks the RL HTTP API that `wtransfer serve` serves (and `vllm serve`, through
`wtransfer_vllm.ServerClient`); `FanoutClient` sends each call to several engine instances at
once (engines behind an external load balancer).

`HTTPClient` also speaks the server's other routes: pause, resume, is_paused, versions and
generate. Init and update infos travel as msgpack (they may hold bytes such as IPC handles);
every other body is JSON. Error replies become the `PeerError` of
`wtransfer.errors.from_reply` (a 409 is a `RemoteLifecycleError`, say); a request past its
deadline becomes `TransferTimeout`. It needs httpx (the `serve` extra), imported on first use.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from wtransfer import wire
from wtransfer.errors import (
    ConfigError,
    IntegrityError,
    PeerError,
    TransferTimeout,
    from_reply,
    relayed_kind,
    remote_error,
)
from wtransfer.protocol import CallQueue, InitFor, PendingCall, WeightSyncClient
from wtransfer.receiver.engine import WeightTransferEngine
from wtransfer.records import PauseMode, check_pause_mode

T = TypeVar("T")


class SingleEngineClient:
    """Mixin for a client that reaches exactly one engine instance: `init_each_engine` is its
    `init_weight_transfer_engine` with the info for workers ``0 .. num_workers()-1``."""

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """Initialize the engine (implemented by the client)."""
        raise NotImplementedError

    def num_workers(self) -> int:
        """Receiving workers behind the engine; 1 unless the client knows better."""
        return 1

    def init_each_engine(self, info_for: InitFor) -> None:
        """Initialize the one engine with ``info_for(0, num_workers())``."""
        self.init_weight_transfer_engine(info_for(0, self.num_workers()))


def check_workers(client: object, count: object) -> int:
    """`count` if it is a valid worker count, else `ConfigError` naming the client."""
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise ConfigError(f"{client!r} reports num_workers={count!r}; expected an int >= 1")
    return count


class LocalClient(SingleEngineClient):
    """Drives a `WeightTransferEngine` living in this process (no serialization)."""

    def __init__(self, engine: WeightTransferEngine[Any, Any]) -> None:
        self.engine = engine

    @property
    def weight_version(self) -> str | None:
        """The label of the engine's weights (its last labelled update's)."""
        return self.engine.weight_version

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
        """Finish the update and label the weights `weight_version`."""
        self.engine.finish_weight_update(weight_version)

    def fingerprint(self) -> dict[str, str]:
        """Digest of the engine's target."""
        return self.engine.target.fingerprint()

    def __repr__(self) -> str:
        return f"LocalClient({type(self.engine).__name__})"


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
        self._queues: list[CallQueue] | None = None

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
            raise self.failed(failures)
        return results

    def failed(self, failures: list[tuple[int, BaseException]]) -> Exception:
        """One error for the instances that failed (index, error), led by the first that is
        not a timeout (others often time out only because of it): a `PeerError` of its kind
        (`errors.remote_error`), or `TransferTimeout` when every one timed out; the message
        names each instance."""
        first = next((e for _, e in failures if not isinstance(e, TransferTimeout)),
                     failures[0][1])
        where = ", ".join(f"#{j} ({self.clients[j]!r})" for j, _ in failures)
        message = f"{len(failures)} of {len(self.clients)} instance(s) failed: {where}; " \
                  f"first error: {type(first).__name__}: {first}"
        kind = first.remote_type if isinstance(first, PeerError) and first.remote_type \
            else type(first).__name__
        error = TransferTimeout(message) if isinstance(first, TransferTimeout) \
            else remote_error(message, kind)
        error.__cause__ = first
        return error

    def submit(self, method: str, *, after: FanoutCall | None = None,
               **args: Any) -> FanoutCall:
        """Issue ``method(**args)`` on every instance without waiting (pipelined on each
        instance whose client pipelines; in submission order per instance either way). With
        `after`, each instance runs it only if its part of that call succeeded."""
        if self._queues is None:
            self._queues = [CallQueue(c) for c in self.clients]
        if after is not None and after.fanout is not self:
            raise TypeError("'after' must be a call of this FanoutClient")
        return FanoutCall(self, [
            q.submit(method, after=after.calls[i] if after is not None else None, **args)
            for i, q in enumerate(self._queues)])

    def workers_per_engine(self) -> list[int]:
        """Receiving workers behind each client, in order."""
        return [check_workers(c, n) for c, n in zip(
            self.clients, self.map(lambda c, _: c.num_workers()), strict=True)]

    def num_workers(self) -> int:
        """Receiving workers behind every client together."""
        return sum(self.workers_per_engine())

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """Initialize every instance with the same init info."""
        self.map(lambda c, _: c.init_weight_transfer_engine(init_info))

    def init_each_engine(self, info_for: InitFor) -> None:
        """Initialize client i's engines with ``info_for(first, n)``, where `first` counts the
        workers of clients 0..i-1 and `n` is client i's own."""
        counts = self.workers_per_engine()
        firsts = [sum(counts[:i]) for i in range(len(counts))]
        self.map(lambda c, i: c.init_each_engine(
            lambda first, n: info_for(firsts[i] + first, n)))

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
        for queue in self._queues or []:
            queue.close()

    def __repr__(self) -> str:
        return f"FanoutClient({self.clients!r})"


class FanoutCall:
    """One call issued on every instance of a `FanoutClient` (a `PendingCall`)."""

    def __init__(self, fanout: FanoutClient, calls: list[PendingCall]) -> None:
        self.fanout = fanout
        self.calls = calls

    def done(self) -> bool:
        """Whether every instance answered, or one failed (never blocks)."""
        finished = [call for call in self.calls if call.done()]
        if len(finished) == len(self.calls):
            return True
        for call in finished:
            try:
                call.result(0)
            except Exception:
                return True
        return False

    def result(self, timeout_s: float, spin_from: float | None = None) -> None:
        """Wait up to `timeout_s` for every instance; raise as `FanoutClient.map` does."""
        deadline = time.monotonic() + timeout_s
        failures: list[tuple[int, BaseException]] = []
        for i, call in enumerate(self.calls):
            try:
                call.result(max(0.0, deadline - time.monotonic()), spin_from)
            except Exception as exc:
                failures.append((i, exc))
        if failures:
            raise self.fanout.failed(failures)

    def cancel(self) -> None:
        """Stop waiting on every instance."""
        for call in self.calls:
            call.cancel()


def _error_fields(response: Any) -> dict[str, str]:
    """``{"type", "message"}`` of an error reply: ours (``{"error", "message"}``), or another
    server's (``{"error": text}``, FastAPI's ``{"detail": ...}``, plain text; typed by the
    wtransfer error its text relays, if any)."""
    try:
        body = response.json()
    except ValueError:
        return {"type": "HTTPError", "message": response.text[:500]}
    if isinstance(body, dict) and "message" in body and isinstance(body.get("error"), str):
        return {"type": body["error"], "message": str(body["message"])}
    if isinstance(body, dict) and ("error" in body or "detail" in body):
        message = str(body.get("error", body.get("detail")))
    else:
        message = str(body)[:500]
    return {"type": relayed_kind(message) or "HTTPError", "message": message}


CLIENT_KEEPALIVE_S = 4.0
"""How long an idle HTTP connection is kept for reuse: less than any server keeps one open
(uvicorn's default is 5 s; `wtransfer serve` keeps them far longer), so a request is never
written into a connection the server is closing ("Server disconnected without sending a
response" on a slow host)."""


def http_session(base_url: str, **options: Any) -> Any:
    """An `httpx.Client` for `base_url` whose idle connections expire before a server's."""
    httpx = _httpx()
    limits = httpx.Limits(max_connections=options.pop("max_connections", 100),
                          keepalive_expiry=CLIENT_KEEPALIVE_S)
    return httpx.Client(base_url=base_url, limits=limits, **options)


def _httpx() -> Any:
    try:
        import httpx
    except ImportError:
        raise ConfigError("HTTPClient needs httpx: from the clone, "
                          "pip install -e '.[serve]'") from None
    return httpx


class HTTPClient(SingleEngineClient):
    """A `WeightSyncClient` plus pause/resume/version/generate calls for `wtransfer serve`."""

    def __init__(self, base_url: str, api_key: str | None = None, *,
                 timeout_s: float = 60.0) -> None:
        if not timeout_s > 0:
            raise ConfigError(f"timeout_s must be a positive number of seconds, got {timeout_s}")
        self.base_url = base_url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout_s = timeout_s
        self._http = self._connect()

    def _connect(self) -> Any:
        return http_session(self.base_url, headers=self._headers,
                            timeout=_httpx().Timeout(self.timeout_s))

    def _request(self, method: str, path: str, *, json_body: Any = None, packed: Any = None,
                 params: dict[str, str] | None = None) -> Any:
        httpx = _httpx()
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
                                  f"{self.timeout_s:g}s") from None
        except httpx.TransportError as exc:
            raise PeerError(f"{method} {self.base_url}{path}: cannot reach the server: "
                            f"{exc}") from None
        if response.status_code >= 500:
            # a server that failed inside a request may close the connection without saying
            # so; the next call must not find it in the pool
            self._http.close()
            self._http = self._connect()
        if response.status_code >= 400:
            raise from_reply(_error_fields(response), f"{method} {path} -> "
                                                      f"{response.status_code}")
        if not response.content:
            return None
        if "json" in response.headers.get("content-type", ""):
            return response.json()
        return response.text  # a plain-text answer (vLLM's adapter routes give one)

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

    def num_workers(self) -> int:
        """Receiving workers behind the server (its data-parallel ranks), from /weight_info."""
        return check_workers(self, self._request("GET", "/weight_info").get("num_workers"))

    def pause(self, mode: PauseMode = "abort", clear_cache: bool = True) -> None:
        """POST /pause."""
        self._request("POST", "/pause", params={"mode": check_pause_mode(mode),
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
