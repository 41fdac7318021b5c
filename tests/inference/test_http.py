"""The HTTP server in a real subprocess, driven over real sockets."""

import json
import signal
import subprocess
import sys

import httpx
import pytest
from served import KEY, Server

import wtransfer
import wtransfer.inference
from wtransfer.errors import PeerError, TransferTimeout
from wtransfer.testing.conformance import wait_for


@pytest.fixture(scope="module")
def dev():
    server = Server("--dev-mode", "--api-key", KEY, "--batch-invariant")
    yield server
    server.stop()


def test_generate_plain_and_streamed(dev):
    body = {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 6, "temperature": 0}}
    plain = dev.http.post("/inference/v1/generate", json=body).json()
    choice = plain["choices"][0]
    assert len(choice["token_ids"]) == 6 and choice["finish_reason"] == "length"
    assert choice["weight_versions"] == [{"version": "default", "start": 0, "end": 6}]
    with dev.http.stream("POST", "/inference/v1/generate", json={**body, "stream": True}) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    deltas = [t for e in events[:-2] for t in json.loads(e)["token_ids"]]
    assert deltas == choice["token_ids"] == json.loads(events[-2])["choices"][0]["token_ids"]


def generated_tokens(server) -> int:
    for line in server.http.get("/metrics").text.splitlines():
        if line.startswith("wtransfer_generated_tokens_total "):
            return int(line.split()[1])
    raise AssertionError("metric missing")


def test_a_client_that_disconnects_mid_stream_aborts_its_request(dev):
    before = generated_tokens(dev)
    body = {"token_ids": [5, 5], "stream": True,
            "sampling_params": {"max_tokens": 1500, "temperature": 0}}
    with dev.http.stream("POST", "/inference/v1/generate", json=body) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
    wait_for(lambda: "wtransfer_running_requests 0" in dev.http.get("/metrics").text, 60,
             "the abandoned request to stop")
    assert generated_tokens(dev) - before < 1500, "the abandoned request ran to completion"


@pytest.mark.parametrize("body, status, match", [
    ("not json", 400, "not valid JSON"),
    ({"token_ids": []}, 400, "non-empty"),
    ({"token_ids": [1, -2]}, 400, "non-negative"),
    ({"token_ids": "abc"}, 400, "must be list"),
    ({"token_ids": [1], "sampling_params": {"temperature": "hot"}}, 400, "temperature"),
    ({"token_ids": [1], "sampling_params": {"max_tokens": 0}}, 400, "max_tokens"),
    ({"token_ids": [999999]}, 400, "token ids must be"),
    ({"token_ids": [1], "max_tokens": 5}, 400, "unknown field(s) ['max_tokens']"),
    ({"token_ids": [1], "sampling_params": {"temprature": 0}}, 400, "temprature"),
    ({"token_ids": [1], "sampling_params": {"seed": 2**64}}, 400, "sampling_params.seed"),
    ("[" * 5000 + "]" * 5000, 400, "nests deeper"),
    ({"token_ids": [1], "sampling_params": {"a": [[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]}}, 400,
     "nests deeper"),
])
def test_bad_generate_input_is_a_4xx_that_says_what_to_fix(dev, body, status, match):
    kwargs = {"content": body} if isinstance(body, str) else {"json": body}
    r = dev.http.post("/inference/v1/generate", **kwargs)
    assert r.status_code == status and match in r.json()["message"]
    assert set(r.json()) == {"error", "message"}


def test_every_error_is_json_with_error_and_message(dev):
    missing = dev.http.get("/no/such/route")
    assert missing.status_code == 404
    assert missing.json() == {"error": "NotFound", "message": "no route GET /no/such/route"}
    wrong = dev.http.get("/inference/v1/generate")
    assert wrong.status_code == 405 and wrong.json()["error"] == "MethodNotAllowed"
    unauthorized = httpx.get(dev.url + "/metrics")
    assert unauthorized.status_code == 401 and unauthorized.json()["error"] == "Unauthorized"
    extra = dev.http.post("/update_weight_version", json={"new_version": "v", "force": 1})
    assert extra.status_code == 400 and "unknown field(s) ['force']" in extra.json()["message"]


@pytest.mark.parametrize("label", ['v"1', "v\n1", "line\nbreak", "x" * 257, ""])
def test_unprintable_quoted_or_long_version_labels_are_refused(dev, label):
    label = label.replace("\\n", "\n")
    r = dev.http.post("/update_weight_version", json={"new_version": label})
    if '"' in label or "\\" in label:  # printable: accepted, and escaped in /metrics
        assert r.status_code == 200
        return
    assert r.status_code == 400 and "weight version" in r.json()["message"]


def test_metrics_escape_version_labels(dev):
    assert dev.http.post("/update_weight_version",
                         json={"new_version": 'a"b\\c'}).status_code == 200
    metrics = dev.http.get("/metrics").text
    assert 'wtransfer_weight_version_info{version="a\\"b\\\\c"} 1' in metrics
    assert dev.http.post("/update_weight_version", json={"new_version": "v0"}).status_code == 200


def test_a_non_streaming_client_that_disconnects_aborts_its_request(dev):
    before = generated_tokens(dev)
    body = {"token_ids": [6, 6], "sampling_params": {"max_tokens": 1500, "temperature": 0}}
    with pytest.raises(httpx.ReadTimeout):
        dev.http.post("/inference/v1/generate", json=body, timeout=1.0)
    wait_for(lambda: "wtransfer_running_requests 0" in dev.http.get("/metrics").text, 60,
             "the abandoned request to stop")
    assert generated_tokens(dev) - before < 1500, "the abandoned request ran to completion"


@pytest.mark.parametrize("flags, match", [
    (["--weight-transfer-backend", "bogus"], "unknown backend 'bogus'"),
    (["--device", "cuda:7"], "device 'cuda:7'"),
    (["--device", "tpu"], "device must be"),
    (["--max-loras", "2", "--update-staging", "off"], "land in the staging shadow"),
])
def test_bad_serve_options_fail_at_start_up_in_one_line(flags, match):
    out = subprocess.run([sys.executable, "-m", "wtransfer", "serve", *flags],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert match in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_a_bad_or_taken_port_fails_at_start_up_without_a_traceback(dev):
    """`--port 99999` is refused by the argument parser; a port in use fails in one line
    before the model loads or the banner claims to serve."""
    out = subprocess.run([sys.executable, "-m", "wtransfer", "serve", "--port", "99999"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "must be a port number in 0..65535" in out.stderr
    assert "Traceback" not in out.stderr
    out = subprocess.run([sys.executable, "-m", "wtransfer", "serve", "--port", str(dev.port)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stdout == "", out.stdout
    assert f"cannot listen on 127.0.0.1:{dev.port}" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_dev_endpoints_and_their_errors(dev):
    h = dev.http
    assert h.get("/is_paused").json() == {"is_paused": False}
    assert h.post("/pause", params={"mode": "freeze"}).status_code == 400
    assert h.post("/pause", params={"mode": "keep", "clear_cache": "maybe"}).status_code == 400
    assert h.post("/pause", params={"mode": "keep", "clear_cache": "false"}).status_code == 200
    assert h.get("/is_paused").json() == {"is_paused": True}
    assert h.post("/abort_requests", json={}).json() == {"aborted": 0}
    assert h.post("/abort_requests", json={"request_ids": [1]}).status_code == 400
    assert h.post("/update_weights", json={"update_info": {}}).status_code == 409
    assert h.post("/update_weight_version", json={"new_version": "v8"}).status_code == 200
    assert h.get("/weight_info").json() == {  # auto staging: decided at start-up
        "weight_version": "v8", "num_workers": 1, "update_state": "none", "torn": False,
        "failure": None, "rollback": False, "update_staging": "swap", "update_stall_ms": 0.0,
        "update_commit_ms": 0.0, "previous_version": None, "adapters": {},
        "workers": [{"worker": 0, "update_state": "none", "update_bytes": 0,
                     "last_update_bytes": 0, "kept_bytes": 427520, "torn": False,
                     "failure": None}]}
    assert h.post("/update_weight_version", json={}).status_code == 400
    assert len(h.get("/weight_fingerprint").json()["fingerprint"]) > 10
    assert h.post("/resume").status_code == 200
    metrics = h.get("/metrics").text
    assert "wtransfer_paused 0" in metrics and 'version="v8"' in metrics
    assert "# HELP wtransfer_last_transfer_bytes bytes the engine's receiver took in" in metrics


def test_pause_takes_its_mode_from_a_json_body_as_from_the_query(dev):
    """`POST /pause` with ``{"mode": "keep"}`` keeps the running request (it used to be
    ignored, and the default abort ended it); a garbage or unknown body, or a mode given
    twice differently, is a 400 and pauses nothing; /resume refuses a body too."""
    import threading

    h = dev.http
    result = {}

    def generate():
        result["out"] = h.post("/inference/v1/generate", json={
            "token_ids": [4, 4, 4], "sampling_params": {"max_tokens": 300, "temperature": 0}},
            timeout=120).json()

    thread = threading.Thread(target=generate)
    thread.start()
    try:
        wait_for(lambda: "wtransfer_running_requests 1" in h.get("/metrics").text, 30,
                 "the request to run")
        for bad in ({"content": b"not json"}, {"json": {"mode": "keep", "oops": 1}},
                    {"json": {"mode": "keep"}, "params": {"mode": "abort"}},
                    {"json": {"clear_cache": "maybe"}}, {"json": ["keep"]}):
            reply = h.post("/pause", **bad)
            assert reply.status_code == 400, (bad, reply.text)
        assert h.get("/is_paused").json() == {"is_paused": False}
        reply = h.post("/pause", json={"mode": "keep", "clear_cache": False})
        assert reply.json() == {"status": "paused", "mode": "keep", "clear_cache": False}
        assert h.get("/is_paused").json() == {"is_paused": True}
        assert h.post("/resume", content=b"garbage").status_code == 400
        assert h.post("/resume", json={"x": 1}).status_code == 400
        assert h.get("/is_paused").json() == {"is_paused": True}
        assert h.post("/resume").status_code == 200
    finally:
        thread.join(120)
    choice = result["out"]["choices"][0]
    assert choice["finish_reason"] == "length" and len(choice["token_ids"]) == 300


def test_auth_is_required_on_every_route(dev):
    for path in ("/health", "/weight_info", "/metrics"):
        assert httpx.get(dev.url + path).status_code == 401
        assert httpx.get(dev.url + path,
                         headers={"Authorization": "Bearer wrong"}).status_code == 401


def test_weight_update_from_a_trainer_process_over_http_with_two_spans(dev):
    import threading

    h = dev.http
    assert h.post("/update_weight_version", json={"new_version": "v8"}).status_code == 200
    result = {}

    def generate():
        result["out"] = h.post("/inference/v1/generate", json={
            "token_ids": [9, 8, 7], "sampling_params": {"max_tokens": 400, "temperature": 0}},
            timeout=120).json()

    thread = threading.Thread(target=generate)
    thread.start()
    wait_for(lambda: "wtransfer_running_requests 1" in h.get("/metrics").text, 30,
             "the request to run")
    assert h.post("/pause", params={"mode": "keep", "clear_cache": "true"}).status_code == 200
    client = wtransfer.HTTPClient(dev.url, api_key=KEY)
    model = wtransfer.inference.load_model("tiny", seed=3)
    with wtransfer.trainer_init(wtransfer_ipc().IPCTrainerInitInfo(bucket_bytes=1 << 16),
                                client=client, source=wtransfer.ModuleSource(model)) as sender:
        sender.send_weights(weight_version="http-1")
    info = h.get("/weight_info").json()
    assert (info["weight_version"], info["num_workers"]) == ("http-1", 1)
    assert (info["update_state"], info["torn"], info["update_staging"]) == ("ready", False,
                                                                            "swap")
    assert client.fingerprint() == wtransfer.fingerprint(model.state_dict())
    h.post("/resume")
    thread.join(120)
    spans = result["out"]["choices"][0]["weight_versions"]
    assert [s["version"] for s in spans] == ["v8", "http-1"]
    assert spans[0]["end"] == spans[1]["start"] and spans[1]["end"] == 400


def wtransfer_ipc():
    import wtransfer_ipc
    return wtransfer_ipc


def test_http_client_reports_server_errors_with_their_type(dev):
    """An update call outside an update is refused with its type relayed: `LifecycleError`,
    or `NotInitializedError` (one of them) while no test before this one initialized the
    shared server."""
    client = wtransfer.HTTPClient(dev.url, api_key=KEY)
    with pytest.raises(PeerError, match=r"409: (LifecycleError|NotInitializedError)") as err:
        client.update_weights({})
    assert err.value.remote_type in ("LifecycleError", "NotInitializedError")
    with pytest.raises(PeerError, match="401"):
        wtransfer.HTTPClient(dev.url).get_weight_version()


def test_dev_routes_are_404_without_dev_mode_and_sigterm_aborts_live_requests():
    import threading

    server = Server()
    result = {}
    try:
        for method, path in (("POST", "/pause"), ("GET", "/weight_info")):
            refused = server.http.request(method, path)
            assert refused.status_code == 404
            assert "start the server with --dev-mode" in refused.json()["message"]
        assert server.http.get("/health").status_code == 200
        slash = server.http.get("/health/")
        assert slash.status_code == 404 and "did you mean /health?" in slash.json()["message"]

        def long_request():
            result["out"] = server.http.post("/inference/v1/generate", json={
                "token_ids": [1], "sampling_params": {"max_tokens": 2000}}, timeout=60).json()

        thread = threading.Thread(target=long_request)
        thread.start()
        wait_for(lambda: "wtransfer_running_requests 1" in server.http.get("/metrics").text,
                 30, "the request to run")
    finally:
        log = server.stop()
    thread.join(30)
    assert result["out"]["choices"][0]["finish_reason"] == "abort", log
    assert f"wtransfer serve: http://127.0.0.1:{server.port}" in log  # says what it serves
    assert "model tiny on cpu" in log and "dev mode: off" in log, log
    assert "update staging: auto: swap" in log, log
    assert server.proc.returncode in (0, -signal.SIGTERM)


def test_fanout_client_over_two_servers():
    servers = [Server("--dev-mode"), Server("--dev-mode")]
    try:
        fan = wtransfer.FanoutClient([wtransfer.HTTPClient(s.url) for s in servers])
        model = wtransfer.inference.load_model("tiny", seed=11)
        with wtransfer.trainer_init(wtransfer_ipc().IPCTrainerInitInfo(bucket_bytes=1 << 16),
                                    client=fan, source=wtransfer.ModuleSource(model)) as sender:
            sender.send_weights(weight_version="fan-1")
        assert fan.fingerprint() == wtransfer.fingerprint(model.state_dict())
        assert [s.http.get("/weight_info").json()["weight_version"] for s in servers] == \
            ["fan-1", "fan-1"]
    finally:
        for s in servers:
            s.stop()


def test_oversized_bodies_are_refused_with_or_without_a_length(dev):
    big = b"[" + b"1," * (40 << 20) + b"1]"
    r = dev.http.post("/inference/v1/generate", content=big,
                      headers={"Content-Type": "application/json"})
    assert r.status_code == 413

    def chunks():
        for _ in range(70):
            yield b" " * (1 << 20)

    r = dev.http.post("/update_weight_version", content=chunks())
    assert r.status_code == 413 and "exceeds" in r.json()["message"]


def test_data_parallel_server_pauses_and_updates_every_rank_over_http():
    import threading

    server = Server("--dev-mode", "--batch-invariant", "--data-parallel-size", "2",
                    "--dp-sync-interval", "4")
    results = {}
    try:
        h = server.http

        def generate(i):
            results[i] = h.post("/inference/v1/generate", json={
                "token_ids": [i + 1, 5], "sampling_params": {"max_tokens": 300,
                                                            "temperature": 0}},
                timeout=120).json()

        threads = [threading.Thread(target=generate, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        wait_for(lambda: "wtransfer_running_requests 4" in h.get("/metrics").text, 30,
                 "four requests to run (two per rank)")
        assert h.post("/pause", params={"mode": "keep"}).status_code == 200
        client = wtransfer.HTTPClient(server.url)
        assert client.num_workers() == 2
        model = wtransfer.inference.load_model("tiny", seed=4)
        with wtransfer.trainer_init(wtransfer_ipc().IPCTrainerInitInfo(bucket_bytes=1 << 16),
                                    client=client, source=wtransfer.ModuleSource(model)) as s:
            s.send_weights(weight_version="dp-1")
        assert client.fingerprint() == wtransfer.fingerprint(model.state_dict())
        info = h.get("/weight_info").json()
        assert (info["weight_version"], info["num_workers"], info["torn"]) == ("dp-1", 2, False)
        assert h.post("/resume").status_code == 200
        for t in threads:
            t.join(120)
    finally:
        log = server.stop()
    for i in range(4):
        spans = results[i]["choices"][0]["weight_versions"]
        assert [s["version"] for s in spans] == ["default", "dp-1"], log
        assert spans[1]["end"] == 300


def test_a_replaced_sender_changes_nothing_over_http_on_every_data_parallel_rank():
    """Two trainer_inits against one `wtransfer serve --data-parallel-size 2` (a re-run
    notebook cell): the first sender's send_weights raises SenderReplacedError at once, every
    rank keeps its weights (generate answers the same tokens under the same version), and the
    second sender's update lands on both ranks. A bad version label is refused before any byte
    moves: nothing opens on the server."""
    from wtransfer.errors import ConfigError, SenderReplacedError

    server = Server("--dev-mode", "--batch-invariant", "--data-parallel-size", "2")
    try:
        client = wtransfer.HTTPClient(server.url)
        before_print = client.fingerprint()
        before = client.generate([3, 1, 4], max_tokens=8, temperature=0)["choices"][0]
        info = wtransfer_ipc().IPCTrainerInitInfo(bucket_bytes=1 << 16)
        old = wtransfer.inference.load_model("tiny", seed=21)
        new = wtransfer.inference.load_model("tiny", seed=22)
        stale = wtransfer.trainer_init(info, client=client, source=wtransfer.ModuleSource(old))
        current = wtransfer.trainer_init(info, client=client,
                                         source=wtransfer.ModuleSource(new))
        client.pause(mode="wait")  # data-parallel ranks receive only under the global pause
        with pytest.raises(SenderReplacedError, match="replaced by a newer trainer_init"):
            stale.send_weights(weight_version="stale")
        assert client.fingerprint() == before_print
        client.resume()
        again = client.generate([3, 1, 4], max_tokens=8, temperature=0)["choices"][0]
        assert again["token_ids"] == before["token_ids"] and len(set(again["token_ids"])) > 1
        assert again["weight_versions"] == before["weight_versions"]
        with pytest.raises(ConfigError, match="printable"):
            current.send_weights(weight_version="a\nb")
        weight_info = server.http.get("/weight_info").json()
        assert (weight_info["update_state"], weight_info["weight_version"]) == ("ready",
                                                                                "default")
        client.pause(mode="wait")
        current.send_weights(weight_version="current")
        assert client.fingerprint() == wtransfer.fingerprint(new.state_dict())
        client.resume()
        after = client.generate([3, 1, 4], max_tokens=8, temperature=0)["choices"][0]
        assert after["weight_versions"] == [{"version": "current", "start": 0, "end": 8}]
        with pytest.raises(SenderReplacedError):
            stale.send_weights()
        assert client.fingerprint() == wtransfer.fingerprint(new.state_dict())
        stale.shutdown()
        current.shutdown()
    finally:
        server.stop()


@pytest.mark.parametrize("backend", ["ipc", pytest.param("nccl", marks=pytest.mark.extended)])
def test_a_delta_sender_initializes_a_restarted_engine_again_and_sends_in_full(backend):
    """The engine restarts on the same URL between two steps (it lost the sender's init and
    the delta's base): the next send_weights initializes it again by itself and lands in
    full; the one after is a delta again."""
    from wtransfer_nccl import NCCLTrainerInitInfo

    from wtransfer.shapes import perturb

    flags = ("--dev-mode", "--weight-transfer-backend", backend, "--dtype", "bfloat16")
    server = Server(*flags)
    model = wtransfer.inference.load_model("tiny", seed=3, dtype="bfloat16")
    info = (NCCLTrainerInitInfo(master_address="127.0.0.1", timeout_s=60, delta=True)
            if backend == "nccl" else
            wtransfer_ipc().IPCTrainerInitInfo(bucket_bytes=1 << 16, delta=True))
    client = wtransfer.HTTPClient(server.url)
    try:
        with wtransfer.trainer_init(info, client=client,
                                    source=wtransfer.ModuleSource(model)) as sender:
            sender.send_weights(weight_version="1")
            perturb(model, 0.01, seed=1)
            assert sender.send_weights(weight_version="2").changed_fraction is not None
            server.stop()
            server = Server(*flags, port=server.port)
            perturb(model, 0.01, seed=2)
            stats = sender.send_weights(weight_version="3")
            assert stats.changed_fraction is None and stats.bytes == stats.wire_bytes
            assert client.fingerprint() == wtransfer.fingerprint(model.state_dict())
            perturb(model, 0.01, seed=3)
            assert sender.send_weights(weight_version="4").changed_fraction is not None
            assert client.fingerprint() == wtransfer.fingerprint(model.state_dict())
            assert server.http.get("/weight_info").json()["weight_version"] == "4"
    finally:
        server.stop()


def test_a_sender_broken_by_a_dead_engine_sends_in_full_once_it_comes_back():
    """The engine dies (SIGKILL) between two steps: the next update fails, and the nccl
    sender, its group torn down, is unusable as it stands. The engine comes back on the same
    URL: the update after it hears that engine's refusal of start (it holds no sender), not
    the sender's own 'unusable', initializes it again by itself and lands in full,
    bit-exact."""
    from wtransfer_nccl import NCCLTrainerInitInfo

    from wtransfer.shapes import perturb

    flags = ("--dev-mode", "--weight-transfer-backend", "nccl", "--dtype", "bfloat16")
    server = Server(*flags)
    model = wtransfer.inference.load_model("tiny", seed=3, dtype="bfloat16")
    info = NCCLTrainerInitInfo(master_address="127.0.0.1", timeout_s=20)
    client = wtransfer.HTTPClient(server.url, timeout_s=20)
    try:
        with wtransfer.trainer_init(info, client=client,
                                    source=wtransfer.ModuleSource(model)) as sender:
            sender.send_weights(weight_version="1")
            server.proc.kill()
            server.proc.wait(timeout=30)
            perturb(model, 0.01, seed=1)
            with pytest.raises((PeerError, TransferTimeout)):
                sender.send_weights(weight_version="2")
            server.log.close()
            server = Server(*flags, port=server.port)
            stats = sender.send_weights(weight_version="3")
            assert stats.bytes == sum(t.numel() * t.element_size()
                                      for t in model.state_dict().values())
            assert client.fingerprint() == wtransfer.fingerprint(model.state_dict())
            assert server.http.get("/weight_info").json()["weight_version"] == "3"
    finally:
        server.stop()


def test_an_idle_connection_outlives_the_clients_reuse_window(dev):
    """The server keeps an idle keep-alive connection open well past the time a client reuses
    one (`CLIENT_KEEPALIVE_S`): a request written into a connection idle for longer than
    uvicorn's default 5 s still gets its answer (the 'Server disconnected without sending a
    response' of a slow host: the client reused a connection as the server closed it)."""
    import socket
    import time

    from wtransfer.control.clients import CLIENT_KEEPALIVE_S

    request = (f"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
               "\r\n").encode()

    def answer(sock):
        sock.sendall(request)
        got = b""
        while b'"status"' not in got:  # headers and body may come in two reads
            chunk = sock.recv(4096)
            assert chunk, f"the server closed the connection: {got!r}"
            got += chunk
        return got

    with socket.create_connection(("127.0.0.1", dev.port), timeout=10) as sock:
        assert answer(sock).startswith(b"HTTP/1.1 200")
        time.sleep(max(6.0, CLIENT_KEEPALIVE_S + 1))  # idle on purpose: the case itself
        assert answer(sock).startswith(b"HTTP/1.1 200")
