"""Several weight-sync calls in one request (`POST /weight_calls`), against a real `wtransfer
serve`: a lone sender's update in one round trip, each call run only after the one it names
succeeded, a malformed batch refused whole before any call runs, the API key required."""

import httpx
import pytest
import torch
from served import KEY, Server

import wtransfer
import wtransfer.inference
from wtransfer import wire
from wtransfer.errors import ConfigError, LifecycleError, PeerError
from wtransfer.protocol import BatchedCall


@pytest.fixture(scope="module")
def served():
    server = Server("--dev-mode", "--api-key", KEY)
    yield server
    server.stop()


class Requests:
    """Counts the requests `client` sends, by path, and the calls each carries (each still
    goes to the server)."""

    def __init__(self, client: wtransfer.HTTPClient) -> None:
        self.paths: list[str] = []
        self.batches: list[list[str]] = []
        http = client._http
        request, lines = http.request, http.lines

        def counted_request(method, path, **kwargs):
            self.paths.append(path)
            self.batches.append([path.lstrip("/")])
            return request(method, path, **kwargs)

        def counted_lines(method, path, **kwargs):
            self.paths.append(path)
            self.batches.append([c["method"] for c in wire.decode(kwargs["body"])["calls"]])
            return lines(method, path, **kwargs)

        http.request, http.lines = counted_request, counted_lines


def update_state(server) -> str:
    return server.http.get("/weight_info").json()["update_state"]


def test_a_lone_sender_updates_in_one_request_per_update(served):
    import wtransfer_ipc

    client = wtransfer.HTTPClient(served.url, api_key=KEY)
    model = wtransfer.inference.load_model("tiny", seed=5)
    source = wtransfer.ModuleSource(model)
    with wtransfer.trainer_init(wtransfer_ipc.IPCTrainerInitInfo(), client=client,
                                source=source) as sender:
        requests = Requests(client)
        for step in range(3):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.5)
            sender.send_weights(weight_version=f"one-{step}")
            assert client.fingerprint() == wtransfer.fingerprint(model.state_dict())
    batches = [b for b in requests.batches if b != ["weight_fingerprint"]]
    assert batches == [["start_weight_update", "update_weights",
                        "finish_weight_update"]] * 3  # one request each
    assert requests.paths.count("/weight_calls") == 3
    assert served.http.get("/weight_info").json()["weight_version"] == "one-2"


def test_buckets_after_the_first_go_as_they_are_packed(served):
    """Many buckets: start travels with the first bucket's call; every bucket's call goes
    without waiting for the finish, the last with it; the weights land bit-exact."""
    import wtransfer_ipc

    client = wtransfer.HTTPClient(served.url, api_key=KEY)
    model = wtransfer.inference.load_model("tiny", seed=6)
    info = wtransfer_ipc.IPCTrainerInitInfo(bucket_bytes=1 << 16, num_buffers=2)
    with wtransfer.trainer_init(info, client=client,
                                source=wtransfer.ModuleSource(model)) as sender:
        requests = Requests(client)
        stats = sender.send_weights(weight_version="many")
    assert stats.buckets > 3
    assert client.fingerprint() == wtransfer.fingerprint(model.state_dict())
    calls = [m for batch in requests.batches for m in batch if m != "weight_fingerprint"]
    assert requests.batches[0][:2] == ["start_weight_update", "update_weights"]
    assert calls == (["start_weight_update"] + ["update_weights"] * stats.buckets
                     + ["finish_weight_update"])


def test_calls_too_many_for_one_request_go_one_by_one(served, monkeypatch):
    """A batch over the client's limit is never sent: its calls go alone, and land."""
    import wtransfer_ipc

    from wtransfer.control import clients

    monkeypatch.setattr(clients, "MAX_BATCH_BYTES", 1)
    client = wtransfer.HTTPClient(served.url, api_key=KEY)
    model = wtransfer.inference.load_model("tiny", seed=8)
    with wtransfer.trainer_init(wtransfer_ipc.IPCTrainerInitInfo(), client=client,
                                source=wtransfer.ModuleSource(model)) as sender:
        requests = Requests(client)
        sender.send_weights(weight_version="alone")
    assert client.fingerprint() == wtransfer.fingerprint(model.state_dict())
    assert "/weight_calls" not in requests.paths
    assert requests.paths[:3] == ["/start_weight_update", "/update_weights",
                                  "/finish_weight_update"]


def test_a_call_runs_only_after_the_one_it_names_succeeded(served):
    """start, a second start after it (refused: an update is open), an update after that
    (skipped), then a discard that names nothing (it runs): each answer is the call's own."""
    client = wtransfer.HTTPClient(served.url, api_key=KEY)
    assert update_state(served) != "updating"
    answers = list(client.call_batch([
        BatchedCall("start_weight_update", {}, None),
        BatchedCall("start_weight_update", {}, 0),
        BatchedCall("update_weights", {"update_info": {"tensors": []}}, 1),
        BatchedCall("discard_weight_update", {"reason": "a test"}, None)]))
    assert answers[0] is None and answers[3] is None
    assert isinstance(answers[1], LifecycleError) and isinstance(answers[1], PeerError)
    assert "POST /start_weight_update -> 409" in str(answers[1])
    assert isinstance(answers[2], LifecycleError)
    assert "update_weights skipped: it was to run after start_weight_update" in str(answers[2])
    assert update_state(served) == "failed"  # discarded: nothing of it went live


@pytest.mark.parametrize("calls, message", [
    ([{"method": "start_weight_update"}, {"method": "rollback_weights"}],
     "'rollback_weights' cannot be batched"),
    ([{"method": "start_weight_update", "after": 0}], "after must be the index of an earlier"),
    ([{"method": "update_weights", "body": wire.encode({"update_info": [1]})}],
     "(update_weights): field 'update_info' must be dict"),
    ([{"method": "finish_weight_update", "body": wire.encode({"version": "x"})}],
     "unknown field(s) ['version']"),
    ([{"method": "start_weight_update", "body": b"\xc1"}], "calls[0] (start_weight_update)"),
    ([], "calls must hold 1 to"),
])
def test_a_malformed_batch_is_refused_whole_before_any_call_runs(served, calls, message):
    before = update_state(served)
    reply = served.http.post("/weight_calls", content=wire.encode({"calls": calls}),
                             headers={"Content-Type": "application/msgpack"})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"] == "ConfigError" and message in reply.json()["message"]
    assert update_state(served) == before  # the valid start in the first batch never ran


def test_a_batch_needs_the_api_key(served):
    body = wire.encode({"calls": [{"method": "start_weight_update"}]})
    before = update_state(served)
    reply = httpx.post(served.url + "/weight_calls", content=body,
                       headers={"Content-Type": "application/msgpack"})
    assert reply.status_code == 401 and reply.json()["error"] == "Unauthorized"
    with pytest.raises(PeerError, match="401"):
        list(wtransfer.HTTPClient(served.url, api_key="wrong").call_batch(
            [BatchedCall("start_weight_update", {}, None)]))
    assert update_state(served) == before


def test_the_client_refuses_a_call_it_cannot_batch(served):
    with pytest.raises(ConfigError, match="cannot be batched"):
        list(wtransfer.HTTPClient(served.url, api_key=KEY).call_batch(
            [BatchedCall("fingerprint", {}, None)]))


def test_a_lone_sender_with_its_own_data_plane_moves_its_bytes_with_or_without_a_pause():
    """nccl (gloo here): the receivers must hear of the update before any byte moves, with
    the finish behind the update call or, with a pause around the finish, after every byte
    moved; both land bit-exact within the deadline."""
    from wtransfer_nccl import NCCLTrainerInitInfo

    server = Server("--dev-mode", "--weight-transfer-backend", "nccl")
    model = wtransfer.inference.load_model("tiny", seed=7)
    client = wtransfer.HTTPClient(server.url, timeout_s=20)
    try:
        with wtransfer.trainer_init(NCCLTrainerInitInfo(master_address="127.0.0.1",
                                                        timeout_s=20),
                                    client=client, source=wtransfer.ModuleSource(model)) as s:
            requests = Requests(client)
            s.send_weights(weight_version="plain")
            assert client.fingerprint() == wtransfer.fingerprint(model.state_dict())
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(-1)
            s.send_weights(weight_version="paused", pause="keep")
            assert client.fingerprint() == wtransfer.fingerprint(model.state_dict())
        assert server.http.get("/weight_info").json()["weight_version"] == "paused"
        batches = [b for b in requests.batches if b != ["weight_fingerprint"]]
        assert batches[0] == ["start_weight_update", "update_weights", "finish_weight_update"]
        assert batches[1] == ["start_weight_update", "update_weights"]
        assert batches[2:] == [["pause"], ["finish_weight_update"], ["resume"]]
    finally:
        server.stop()


def test_a_fleet_instance_takes_start_and_update_in_one_request(served):
    """A `FanoutClient` of two servers: each instance's start and update go in one request,
    then the fleet's two phases (stage everywhere, then finish); every instance bit-exact."""
    import wtransfer_ipc

    other = Server("--dev-mode", "--api-key", KEY)
    clients = [wtransfer.HTTPClient(s.url, api_key=KEY) for s in (served, other)]
    fleet = wtransfer.FanoutClient(clients)
    try:
        model = wtransfer.inference.load_model("tiny", seed=9)
        with wtransfer.trainer_init(wtransfer_ipc.IPCTrainerInitInfo(), client=fleet,
                                    source=wtransfer.ModuleSource(model)) as sender:
            counted = [Requests(c) for c in clients]
            sender.send_weights(weight_version="fleet-1")
        for client, requests in zip(clients, counted, strict=True):
            assert client.fingerprint() == wtransfer.fingerprint(model.state_dict())
            assert requests.batches[:3] == [["start_weight_update", "update_weights"],
                                            ["stage_weight_update"],
                                            ["finish_weight_update"]]
    finally:
        fleet.close()
        other.stop()
