"""`HTTPConnections`: keep-alive HTTP/1.1 connections to one server, for control calls.

A control call is a small request and a small answer, so what it costs is the client's own
overhead: on the 2-core VM against `wtransfer serve`, a control call (`GET /weight_info`,
median of 200, `benchmarks/http_overhead.py`) took 0.89 ms through these connections and
1.51 ms through a bare httpx client in the same run. This pool lends each call a connection
of its own (a fleet calls one server from several threads), reuses one that is fresh, and
drops one idle for longer than `CLIENT_KEEPALIVE_S` (less than any server keeps one open, so
a request is never written into a connection the server is closing) or that the server has
closed (a restarted engine; a server may still close one between that check and the
request, which then fails with `PeerError`). It connects directly: proxy settings in the
environment are not consulted (a control plane reaches its engines on the cluster's own
network).
"""

from __future__ import annotations

import http.client
import json
import select
import threading
import time
import urllib.parse
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

from wtransfer.errors import ConfigError

MAX_LINE_BYTES = 1 << 20
"""The longest line of a streamed answer read at once (`HTTPConnections.lines`)."""
CLIENT_KEEPALIVE_S = 4.0
"""How long an idle HTTP connection is kept for reuse: less than any server keeps one open
(uvicorn's default is 5 s; `wtransfer serve` keeps them far longer), so a request is never
written into a connection the server is closing ("Server disconnected without sending a
response")."""


@dataclass(frozen=True)
class Reply:
    """One HTTP answer: its status, content type and body."""

    status: int
    content_type: str
    content: bytes

    @property
    def text(self) -> str:
        """The body as text."""
        return self.content.decode(errors="replace")

    def json(self) -> Any:
        """The body parsed as JSON (`ValueError` if it is not)."""
        return json.loads(self.content)


class HTTPStatusError(Exception):
    """An error status in answer to a streamed request (`HTTPConnections.lines`)."""

    def __init__(self, reply: Reply) -> None:
        super().__init__(f"HTTP {reply.status}")
        self.reply = reply


class HTTPConnections:
    """Connections to the server at `base_url` (http or https), each used by one call at a
    time; `timeout_s` bounds every connect, send and read."""

    def __init__(self, base_url: str, *, timeout_s: float,
                 headers: dict[str, str] | None = None) -> None:
        parts = urllib.parse.urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(f"not an http(s) URL: {base_url!r}")
        self._connection_class = (http.client.HTTPSConnection if parts.scheme == "https"
                                  else http.client.HTTPConnection)
        self._host = parts.hostname
        self._port = parts.port
        self._prefix = parts.path.rstrip("/")
        self._timeout_s = timeout_s
        self._headers = dict(headers or {})
        self._idle: list[tuple[http.client.HTTPConnection, float]] = []
        self._lock = threading.Lock()

    def request(self, method: str, path: str, *, body: bytes | None = None,
                headers: dict[str, str] | None = None,
                params: dict[str, str] | None = None) -> Reply:
        """Send one request and read its whole answer. Raises `TimeoutError` past the
        timeout and `OSError` or `http.client.HTTPException` when the server cannot be
        reached or drops the connection; the connection is then closed, not reused."""
        target = self._prefix + path
        if params:
            target += "?" + urllib.parse.urlencode(params)
        connection = self._take()
        try:
            connection.request(method, target, body=body,
                               headers={**self._headers, **(headers or {})})
            response = connection.getresponse()
            content = response.read()
        except BaseException:
            connection.close()
            raise
        reply = Reply(response.status, response.getheader("Content-Type") or "", content)
        # (a server failing inside a request may drop it unsaid)
        self._give_back(connection, reusable=not response.will_close and reply.status < 500)
        return reply

    def lines(self, method: str, path: str, *, body: bytes | None = None,
              headers: dict[str, str] | None = None) -> Generator[bytes, None, None]:
        """Send one request and yield its answer's body line by line as it arrives (a
        streamed answer); an error status yields nothing and raises `HTTPStatusError` with
        the whole reply. Failures as `request`; a connection not read to its end is closed."""
        connection = self._take()
        read_whole = False
        try:
            connection.request(method, self._prefix + path, body=body,
                               headers={**self._headers, **(headers or {})})
            response = connection.getresponse()
            if response.status >= 400:
                raise HTTPStatusError(Reply(response.status,
                                            response.getheader("Content-Type") or "",
                                            response.read()))
            while line := response.readline(MAX_LINE_BYTES):
                yield line
            read_whole = not response.will_close
        finally:
            self._give_back(connection, reusable=read_whole)

    def _give_back(self, connection: http.client.HTTPConnection, *, reusable: bool) -> None:
        """Keep `connection` for the next call when `reusable`, else close it."""
        if not reusable:
            connection.close()
            return
        with self._lock:
            self._idle.append((connection, time.monotonic()))

    def _take(self) -> http.client.HTTPConnection:
        """A fresh idle connection that the server has not closed, or a new one."""
        while True:
            now = time.monotonic()
            with self._lock:
                stale = [c for c, since in self._idle if now - since >= CLIENT_KEEPALIVE_S]
                self._idle = [(c, since) for c, since in self._idle
                              if now - since < CLIENT_KEEPALIVE_S]
                taken = self._idle.pop()[0] if self._idle else None
            for connection in stale:
                connection.close()
            if taken is None:
                return self._connection_class(self._host, self._port, timeout=self._timeout_s)
            if not _closed_by_server(taken):
                return taken
            taken.close()  # (another idle one may still be open)

    def close(self) -> None:
        """Close the idle connections (a call still running closes or keeps its own)."""
        with self._lock:
            idle, self._idle = self._idle, []
        for connection, _ in idle:
            connection.close()


def _closed_by_server(connection: http.client.HTTPConnection) -> bool:
    """Whether an idle connection's socket is readable or hung up: the server closed it (or
    sent what nobody asked for); either way it cannot carry the next request."""
    sock = connection.sock
    if sock is None:
        return True
    try:
        poller = select.poll()  # (select.select refuses descriptors past 1023)
        poller.register(sock, select.POLLIN | select.POLLERR | select.POLLHUP)
        return bool(poller.poll(0))
    except (OSError, ValueError):
        return True
