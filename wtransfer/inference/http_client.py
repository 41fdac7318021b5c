"""`HTTPClient`: the trainer's client for a `wtransfer serve` server (needs the `serve` extra).

It is a `WeightSyncClient` (init, start, update, finish, fingerprint, num_workers) and also
speaks the server's other routes: pause, resume, is_paused, versions and generate. Init and
update infos travel as msgpack (they may hold bytes such as IPC handles); every other body is
JSON. Error replies become the `PeerError` of `wtransfer.errors.from_reply` (a 409 is a
`RemoteLifecycleError`, say); a request past `timeout` becomes `TransferTimeout`.
"""

from __future__ import annotations

from typing import Any

from wtransfer import wire
from wtransfer.clients import SingleEngineClient, check_workers
from wtransfer.errors import ConfigError, PeerError, TransferTimeout, from_reply, relayed_kind
from wtransfer.inference.commands import PauseMode, check_pause_mode


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


def _httpx() -> Any:
    try:
        import httpx
    except ImportError:
        raise ConfigError("HTTPClient needs httpx: from the clone, "
                          "pip install -e '.[serve]'") from None
    return httpx


class HTTPClient(SingleEngineClient):
    """A `WeightSyncClient` plus pause/resume/version/generate calls for `wtransfer serve`."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 60.0) -> None:
        if not timeout > 0:
            raise ConfigError(f"timeout must be a positive number of seconds, got {timeout}")
        self.base_url = base_url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout = timeout
        self._http = self._connect()

    def _connect(self) -> Any:
        httpx = _httpx()
        return httpx.Client(base_url=self.base_url, headers=self._headers,
                            timeout=httpx.Timeout(self.timeout))

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
                                  f"{self.timeout:g}s") from None
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
        return response.json() if response.content else None

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
