"""`HTTPClient`'s connections (`wtransfer.transport.http_client`) against a real HTTP server:
kept-alive connections the server closed are not reused, timeouts and refusals become the
library's errors, query parameters and a base path reach the server."""

import http.server
import socket
import threading

import pytest

import wtransfer
from wtransfer.errors import ConfigError, PeerError, TransferTimeout
from wtransfer.launch.processes import free_port


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive
    seen: list[str] = []
    answer_slow = threading.Event()
    """Set once the client gave up on the slow call (the handler waits at most 10 s)."""

    def do_GET(self):
        self.seen.append(self.path)
        if self.path.startswith("/base/slow"):
            self.answer_slow.wait(10)
        body = b'{"weight_version": "v1", "path": "%s"}' % self.path.encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        if self.path.startswith("/base/close-after"):
            self.close_connection = True  # the server drops the idle connection, unsaid

    def log_message(self, *args):
        pass


class _Server(http.server.ThreadingHTTPServer):
    """Notes each connection it closes."""

    closed = threading.Event()

    def shutdown_request(self, request):
        super().shutdown_request(request)
        self.closed.set()


@pytest.fixture
def server():
    httpd = _Server(("127.0.0.1", 0), _Handler)
    _Server.closed = threading.Event()
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    _Handler.seen = []
    _Handler.answer_slow = threading.Event()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_a_connection_the_server_closed_while_idle_is_not_reused(server):
    client = wtransfer.HTTPClient(server + "/base", timeout_s=5)
    assert client._request("GET", "/close-after")["path"] == "/base/close-after"
    assert _Server.closed.wait(10)  # the server closed the kept-alive connection
    assert client._request("GET", "/next")["path"] == "/base/next"
    assert client.get_weight_version() == "v1"


def test_query_parameters_reach_the_server(server):
    client = wtransfer.HTTPClient(server + "/base", timeout_s=5)
    client._request("GET", "/q", params={"mode": "keep", "clear_cache": "true"})
    assert _Handler.seen[-1] == "/base/q?mode=keep&clear_cache=true"


def test_a_call_past_its_timeout_raises_transfer_timeout(server):
    client = wtransfer.HTTPClient(server + "/base", timeout_s=0.2)
    with pytest.raises(TransferTimeout, match=r"no answer within 0\.2s"):
        client._request("GET", "/slow")
    _Handler.answer_slow.set()


def test_a_server_that_is_not_there_is_a_peer_error():
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    client = wtransfer.HTTPClient(f"http://127.0.0.1:{port}", timeout_s=2)
    with pytest.raises(PeerError, match="cannot reach the server"):
        client.get_weight_version()


def test_bad_addresses_and_keys_are_refused_up_front():
    with pytest.raises(ConfigError, match="not an http"):
        wtransfer.HTTPClient(f"ftp://127.0.0.1:{free_port()}")
    with pytest.raises(ConfigError, match="printable ASCII"):
        wtransfer.HTTPClient("http://127.0.0.1:1", api_key="key\r\nX-Injected: 1")
