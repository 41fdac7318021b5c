"""The RPC control plane: remote errors come back typed; hostile requests get error replies."""

import collections
import contextlib
import os
import select
import threading
import time

import pytest
import torch
import zmq

import wtransfer
from wtransfer import wire
from wtransfer.control.clients import LocalClient
from wtransfer.control.rpc import ReceiverServer, RPCClient
from wtransfer.errors import LifecycleError, PeerError, TransferTimeout
from wtransfer.protocol import SPIN_WINDOW_S
from wtransfer.testing.conformance import wait_for


@pytest.fixture
def served():
    engine = wtransfer.create_receiver("ipc", wtransfer.ModuleTarget(torch.nn.Linear(4, 4)))
    server = ReceiverServer(engine, "tcp://127.0.0.1:0").start()
    yield server, RPCClient(server.address, timeout_s=5)
    server.close()
    engine.shutdown()


def raw_request(address, payload: bytes) -> dict:
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    sock.send(payload)
    assert sock.poll(5000), "server did not answer a malformed request"
    reply = wire.decode(sock.recv())
    sock.close()
    return reply


def test_remote_lifecycle_error_comes_back_as_peer_error_with_its_type(served):
    _server, client = served
    with pytest.raises(PeerError, match="NotInitializedError: ipc: cannot start") as err:
        client.start_weight_update()
    assert err.value.remote_type == "NotInitializedError"
    assert isinstance(err.value, LifecycleError)  # (a NotInitializedError is one)
    assert client.status()["state"] == "new"


@pytest.mark.parametrize("payload, match", [
    (b"\xc1", "malformed"),
    (wire.encode({"method": "shutdown", "args": {}}), "unknown method"),
    (wire.encode({"method": "fingerprint", "args": {"x": 1}}), "unexpected arguments"),
    (wire.encode([1, 2, 3]), "must be"),
    (b"\x93\x01\x02\x03\x04", "trailing"),
    (wire.encode({"method": "fingerprint", "args": {}, "after": "x"}), "must be a call id"),
    (wire.encode({"method": "fingerprint", "args": {}, "after": 0}), "DEALER"),
])
def test_hostile_requests_get_an_error_reply_and_the_server_keeps_serving(served, payload, match):
    server, client = served
    reply = raw_request(server.address, payload)
    assert reply["ok"] is False and reply["type"] == "MetadataError"
    assert match in reply["message"]
    assert client.fingerprint()  # still serving


def test_a_silent_peer_times_out_and_the_client_recovers(served):
    server, _client = served
    silent = zmq.Context.instance().socket(zmq.ROUTER)  # accepts, never answers
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    client = RPCClient(f"tcp://127.0.0.1:{port}", timeout_s=0.3)
    with pytest.raises(TransferTimeout, match="no answer"):
        client.fingerprint()
    with pytest.raises(TransferTimeout):
        client.fingerprint()
    silent.close(linger=0)
    assert RPCClient(server.address, timeout_s=5).status()["state"] == "new"


def test_a_reply_expected_soon_is_polled_for_only_briefly_past_its_time(served):
    """A trainer polls without sleeping only from when it expects the reply and for
    `SPIN_WINDOW_S` after: a peer that never answers costs it no busy core until the
    deadline, and a reply that comes is read either way."""
    _server, client = served
    assert client.submit("fingerprint").result(5, spin_from=time.monotonic())
    silent = zmq.Context.instance().socket(zmq.ROUTER)  # accepts, never answers
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    waiting = RPCClient(f"tcp://127.0.0.1:{port}", timeout_s=5)
    try:
        cpu = time.process_time()
        with pytest.raises(TransferTimeout):
            waiting.submit("fingerprint").result(1.0, spin_from=time.monotonic())
        used = time.process_time() - cpu  # polling without sleeping the whole second: ~1 s
        assert used < 0.5, f"{used:.2f} s of CPU waiting 1 s (window {SPIN_WINDOW_S} s)"
    finally:
        waiting.close()
        silent.close(linger=0)


def test_a_closed_client_says_so(served):
    server, _client = served
    client = RPCClient(server.address, timeout_s=5)
    assert client.status()["state"] == "new"
    client.close()
    with pytest.raises(LifecycleError, match="was closed; create a new one"):
        client.status()


def test_a_bad_version_label_is_refused_before_any_byte_moves_on_every_path(served):
    """The sender refuses a label no engine would take before it opens an update, and a
    receiver served over RPC refuses it before the update closes (the weights stay as they
    were, the update stays open for a good label)."""
    from wtransfer_ipc import IPCTrainerInitInfo

    from wtransfer.errors import ConfigError

    _server, client = served
    model = torch.nn.Linear(4, 4)
    before = client.fingerprint()
    with wtransfer.trainer_init(IPCTrainerInitInfo(), client=client,
                                source=wtransfer.ModuleSource(model)) as sender:
        for label in ("a\nb", "", "x" * 300):
            with pytest.raises(ConfigError, match="weight version"):
                sender.send_weights(weight_version=label)
            assert client.status()["state"] == "ready"
        assert client.fingerprint() == before
        client.start_weight_update()
        with pytest.raises(PeerError, match="printable"):
            client.finish_weight_update(weight_version="tab\there")
        assert client.status()["state"] == "updating"
        client.finish_weight_update(weight_version="good")
        assert client.status()["weight_version"] == "good"
        sender.send_weights(weight_version="sent")
        assert client.fingerprint() == wtransfer.fingerprint(model.state_dict())


def test_requests_that_arrive_while_replies_go_out_are_served_without_waiting_for_a_poll(
        monkeypatch):
    """The worker thread sends its replies on the socket the serving thread waits on; a send
    can take the socket's signal of a request that just arrived. With the serving thread's
    periodic wake-up pushed past every deadline, such a request is answered only because the
    worker nudges the serving thread: without the nudge, some call here times out."""
    monkeypatch.setattr(wtransfer.rpc, "_POLL_MS", 600_000)
    engine = wtransfer.create_receiver("ipc", wtransfer.ModuleTarget(torch.nn.Linear(4, 4)))
    server = ReceiverServer(engine, "tcp://127.0.0.1:0").start()
    clients = [RPCClient(server.address, timeout_s=5) for _ in range(4)]
    try:
        for _ in range(300):  # several clients in flight at once, replies and requests crossing
            calls = [c.submit("fingerprint") for c in clients for _ in range(3)]
            assert all(call.result() for call in calls)
    finally:
        for c in clients:
            c.close()
        server.close()
        engine.shutdown()


def test_calls_after_a_start_run_in_arrival_order_whichever_thread_reads_them(monkeypatch):
    """After a start the worker thread reads the socket itself while the serving thread may
    too; requests must still run in the order they arrived. The serving thread, between
    reading a finish and queueing it, waits until the worker reads the next start (for up
    to 50 ms: it cannot while the serving thread dispatches): queued first, that start would
    be refused, as an update is open. Every label lands in turn."""
    from wtransfer_ipc import IPCTrainerInitInfo

    monkeypatch.setattr(wtransfer.rpc, "_POLL_MS", 600_000)
    parse = ReceiverServer._parse
    worker_read_a_start = threading.Event()

    def finish_held_for_the_next_start(self, body):
        parsed = parse(self, body)
        reader = threading.current_thread().name
        if parsed[0] == "start_weight_update" and reader == "wtransfer-rpc-exec":
            worker_read_a_start.set()
        elif parsed[0] == "finish_weight_update" and reader == "wtransfer-rpc-io":
            worker_read_a_start.clear()
            worker_read_a_start.wait(0.05)
        return parsed

    monkeypatch.setattr(ReceiverServer, "_parse", finish_held_for_the_next_start)
    engine = wtransfer.create_receiver("ipc", wtransfer.ModuleTarget(torch.nn.Linear(4, 4)))
    server = ReceiverServer(engine, "tcp://127.0.0.1:0").start()
    client = RPCClient(server.address, timeout_s=5)
    try:
        with wtransfer.trainer_init(IPCTrainerInitInfo(), client=client,
                                    source=wtransfer.ModuleSource(torch.nn.Linear(4, 4))):
            calls = []
            for i in range(20):
                calls.append(client.submit("start_weight_update"))
                calls.append(client.submit("finish_weight_update", weight_version=f"v{i}"))
            for call in calls:
                call.result()
            assert client.status()["weight_version"] == "v19"
    finally:
        client.close()
        server.close()
        engine.shutdown()


def test_a_status_answered_by_the_worker_leaves_a_request_behind_it_signalled():
    """After a start the worker thread reads the socket itself and answers a status request
    there. Its send can take the socket's signal of a request that arrived meanwhile; the
    serving thread, waiting on that signal, would then leave the request unread until its
    next periodic wake-up (`_POLL_MS`: ten times an 8B update). Here, on connections that
    already served a call, a second request arrives while the first one's status is worked
    out (waiting for it takes the signal first); after the answer, the serving thread's
    wait must still wake."""
    engine = wtransfer.create_receiver("ipc", wtransfer.ModuleTarget(torch.nn.Linear(4, 4)))
    server = ReceiverServer(engine, "tcp://127.0.0.1:0")  # (its threads not started: this
    ctx = zmq.Context.instance()  # test thread plays the worker)
    first, second = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
    request = [b"", wire.encode({"method": "status", "args": {}})]

    def served(sock, *, as_worker=False):
        """`sock`'s request read and answered on this thread."""
        sock.send_multipart(request)
        assert server._socket.wait(5000), "the request never arrived"
        assert server._read_requests(nudge=as_worker)
        assert sock.poll(5000) and wire.decode(sock.recv_multipart()[-1])["ok"]

    try:
        for sock in (first, second):
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(server.address)
            served(sock)
        reader_wakes = select.poll()  # (what the serving thread waits on)
        reader_wakes.register(server._ready_fd, select.POLLIN)
        reader_wakes.register(server._wake_r, select.POLLIN)
        server._read_requests(nudge=False)  # (takes every signal so far)
        assert not reader_wakes.poll(0), "the socket still signals with no request waiting"
        status = server.status

        def status_while_another_request_arrives():
            second.send_multipart(request)
            assert server._socket.wait(5000), "the second request never arrived"
            return status()

        server.status = status_while_another_request_arrives  # type: ignore[method-assign]
        served(first, as_worker=True)
        assert reader_wakes.poll(1000), \
            "the second request waits, and nothing would wake its reader"
    finally:
        first.close()
        second.close()
        server.close()
        engine.shutdown()


class _StopThatMeets(threading.Event):
    """A stop flag whose check makes the threads named closer-* meet there first: two
    `close` calls that check it before either sets it (the race)."""

    def __init__(self) -> None:
        super().__init__()
        self.meeting = threading.Barrier(2, timeout=0.5)

    def is_set(self) -> bool:
        seen = super().is_set()
        if threading.current_thread().name.startswith("closer"):
            with contextlib.suppress(threading.BrokenBarrierError):
                self.meeting.wait()  # (each answers what it saw before the other went on)
        return seen


def test_close_releases_every_descriptor_once_even_from_two_threads_at_once(monkeypatch):
    """Closing a server (started or not) gives back its socket and wake-up pipe, each pipe
    end exactly once (a second close could close another file's reused descriptor), even
    when two threads close it at the same moment."""
    engine = wtransfer.create_receiver("ipc", wtransfer.ModuleTarget(torch.nn.Linear(4, 4)))
    ReceiverServer(engine, "tcp://127.0.0.1:0").start().close()  # (ZeroMQ's own threads)
    before = len(os.listdir("/proc/self/fd"))
    errors: list[BaseException] = []
    closed: collections.Counter[int] = collections.Counter()
    close_fd = os.close

    def counted_close(fd: int) -> None:
        closed[fd] += 1
        close_fd(fd)

    def close(server):
        try:
            server.close()
        except BaseException as exc:
            errors.append(exc)

    monkeypatch.setattr(os, "close", counted_close)
    try:
        for started in (False, True, True):
            server = ReceiverServer(engine, "tcp://127.0.0.1:0")
            server._stop = _StopThatMeets()
            if started:
                server.start()
            closed.clear()
            closers = [threading.Thread(target=close, args=(server,), name=f"closer-{i}")
                       for i in range(2)]
            for t in closers:
                t.start()
            for t in closers:
                t.join()
            server.close()
            assert (closed[server._wake_r], closed[server._wake_w]) == (1, 1)
        assert errors == []
        # (ZeroMQ closes a socket's descriptors on its own thread, a little later)
        wait_for(lambda: len(os.listdir("/proc/self/fd")) <= before, 5,
                 "the closed servers' descriptors to be released")
    finally:
        engine.shutdown()


def test_a_status_that_cannot_be_read_comes_back_as_an_error_and_serving_goes_on(served):
    server, client = served
    server.status = lambda: {"engine": object()}  # type: ignore[method-assign]
    with pytest.raises(PeerError, match="MetadataError: cannot encode"):
        client.status()
    assert client.fingerprint()  # still serving


def test_a_result_that_cannot_be_sent_comes_back_as_an_error_and_serving_goes_on():
    engine = wtransfer.create_receiver("ipc", wtransfer.ModuleTarget(torch.nn.Linear(4, 4)))

    class Unsendable(LocalClient):
        def fingerprint(self):
            return {"x": object()}

    server = ReceiverServer(Unsendable(engine), "tcp://127.0.0.1:0").start()
    client = RPCClient(server.address, timeout_s=5)
    try:
        with pytest.raises(PeerError, match="MetadataError: cannot encode"):
            client.fingerprint()
        assert client.num_workers() == 1  # still serving
    finally:
        client.close()
        server.close()
        engine.shutdown()
