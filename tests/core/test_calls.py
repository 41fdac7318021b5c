"""Pipelined control calls: replies matched to their calls, late replies dropped, a call chained
after a failed one skipped, on the RPC client and on clients that cannot pipeline."""

import os
import threading

import pytest
import torch
import zmq
from wtransfer_ipc import IPCTrainerInitInfo

import wtransfer
from wtransfer import wire
from wtransfer.control.rpc import ReceiverServer, RPCClient
from wtransfer.errors import LifecycleError, TransferTimeout
from wtransfer.protocol import BatchRefused, CallQueue
from wtransfer.testing.conformance import wait_for
from wtransfer.trainer.calls import UpdateCalls


class _HeldFingerprint(wtransfer.LocalClient):
    """An engine's client whose `fingerprint` waits until the test releases it."""

    def __init__(self, engine) -> None:
        super().__init__(engine)
        self.release = threading.Event()

    def fingerprint(self):
        assert self.release.wait(10), "the test never released the call"
        return super().fingerprint()


@pytest.fixture
def engine():
    engine = wtransfer.create_receiver("ipc", wtransfer.ModuleTarget(torch.nn.Linear(4, 4)))
    yield engine
    engine.shutdown()


def test_a_status_asked_during_a_long_call_gets_its_own_reply_first(engine):
    held = _HeldFingerprint(engine)
    server = ReceiverServer(held).start()
    client = RPCClient(server.address, timeout_s=10)
    slow = client.submit("fingerprint")
    assert client.status()["pid"] == os.getpid()  # answered while the call is held
    assert not slow.done()
    held.release.set()
    assert slow.result() == held.fingerprint()
    assert slow.done()
    client.close()
    server.close()


def test_a_late_reply_is_dropped_and_the_next_call_gets_its_own():
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    client = RPCClient(f"tcp://127.0.0.1:{port}", timeout_s=0.3)
    with pytest.raises(TransferTimeout, match="fingerprint: no answer"):
        client.fingerprint()
    first = router.recv_multipart()  # [identity, call id, b"", request]
    second_call = client.submit("num_workers")
    second = router.recv_multipart()
    assert wire.decode(second[-1])["method"] == "num_workers"
    router.send_multipart([*first[:-1], wire.encode({"ok": True, "result": {"late": "x"}})])
    router.send_multipart([*second[:-1], wire.encode({"ok": True, "result": 3})])
    assert second_call.result() == 3
    client.close()
    router.close()


def _open_elsewhere_then_send(engine, client) -> None:
    """Init a sender over `client`, let another caller open an update, then send."""
    model = torch.nn.Linear(4, 4)
    info = IPCTrainerInitInfo(bucket_bytes=1 << 16, timeout_s=10)
    with wtransfer.trainer_init(info, client=client,
                                source=wtransfer.ModuleSource(model)) as sender:
        engine.start_weight_update()
        with pytest.raises(LifecycleError, match="an update is open"):
            sender.send_weights()


@pytest.mark.parametrize("kind", ["local", "rpc", "fanout"])
def test_calls_behind_a_refused_start_are_skipped_on_every_client(engine, kind):
    server = ReceiverServer(engine).start() if kind != "local" else None
    client = (wtransfer.LocalClient(engine) if server is None
              else RPCClient(server.address, timeout_s=10))
    if kind == "fanout":
        client = wtransfer.FanoutClient([client])
    before = engine.target.fingerprint()
    _open_elsewhere_then_send(engine, client)
    assert engine.target.fingerprint() == before  # nothing landed in the other update
    assert engine.state == "updating"
    if server is not None:
        server.close()


def test_update_calls_report_the_first_failure_in_order(engine):
    queue = CallQueue(wtransfer.LocalClient(engine))
    calls = UpdateCalls(queue, timeout_s=5, weight_version="v")
    calls.start()  # refused: the engine was never initialized
    calls.update({"tensors": []})
    calls.finish()
    with pytest.raises(LifecycleError, match="init_transfer_engine first"):
        calls.settle()
    calls.settle()  # nothing left to wait for
    queue.close()


class _BatchingLocal(wtransfer.LocalClient):
    """A client that batches (as `HTTPClient` does): each batch runs its calls on the engine
    in order, each only if its `after` succeeded, and is recorded by its methods; a batch
    holding "fingerprint" fails whole, as a request that never reached the engine."""

    def __init__(self, engine) -> None:
        super().__init__(engine)
        self.batches: list[list[str]] = []

    def can_batch(self, method):
        return method != "num_workers"

    def call_batch(self, calls):
        self.batches.append([c.method for c in calls])
        if any(c.method == "fingerprint" for c in calls):
            raise ConnectionError("the batch never arrived")
        failed: list[bool] = []
        for call in calls:
            if call.after is not None and failed[call.after]:
                failed.append(True)
                yield LifecycleError(f"{call.method} skipped")
                continue
            try:
                getattr(self, call.method)(**call.args)
            except Exception as exc:
                failed.append(True)
                yield exc
            else:
                failed.append(False)
                yield None


@pytest.fixture
def batching(engine):
    """A batching client on `engine` and its call queue (closed after the test)."""
    client = _BatchingLocal(engine)
    queue = CallQueue(client)
    yield client, queue
    queue.close()


def test_calls_held_together_go_in_one_batch_and_each_gets_its_own_answer(batching):
    client, queue = batching
    with queue.held():
        start = queue.submit("start_weight_update")
        again = queue.submit("start_weight_update", after=start)
        finish = queue.submit("finish_weight_update", after=again, weight_version="x")
    with pytest.raises(LifecycleError, match="finish_weight_update skipped"):
        finish.result(10)
    with pytest.raises(LifecycleError, match="init_transfer_engine first"):
        start.result(0)
    with pytest.raises(LifecycleError, match="start_weight_update skipped"):
        again.result(0)
    assert client.batches == [["start_weight_update"] * 2 + ["finish_weight_update"]]


def test_a_call_after_a_failed_batch_is_skipped_without_reaching_the_engine(batching):
    client, queue = batching
    with queue.held():
        first = queue.submit("fingerprint")
        second = queue.submit("fingerprint", after=first)
    with pytest.raises(ConnectionError, match="never arrived"):
        second.result(10)
    with pytest.raises(ConnectionError, match="never arrived"):
        first.result(0)
    third = queue.submit("start_weight_update", after=second)
    with pytest.raises(LifecycleError, match="start_weight_update skipped: it was to run "
                                             "after fingerprint"):
        third.result(10)
    assert client.batches == [["fingerprint", "fingerprint"]]  # the third never went out
    alone = queue.submit("num_workers")  # one call, or one the client cannot batch: alone
    assert alone.result(10) == 1 and len(client.batches) == 1


class _RefusingBatches(_BatchingLocal):
    """A batching client whose engine side has no batch route: every batch is refused
    before any of it runs (as a server without ``/weight_calls`` answers 404)."""

    def call_batch(self, calls):
        self.batches.append([c.method for c in calls])
        raise BatchRefused("no such route", lasting=True)
        yield  # (a generator, as a client's is)


def test_a_refused_batch_runs_its_calls_alone_and_no_batch_follows(engine):
    client = _RefusingBatches(engine)
    queue = CallQueue(client)
    for _ in range(2):
        with queue.held():
            first = queue.submit("fingerprint")
            second = queue.submit("fingerprint", after=first)
        assert second.result(10) == first.result(0) == engine.target.fingerprint()
    assert client.batches == [["fingerprint", "fingerprint"]]  # once: then each alone
    queue.close()


class _SlowStart(wtransfer.LocalClient):
    """A client whose `num_workers` and start each wait until the test releases them,
    recording what ran."""

    def __init__(self, engine) -> None:
        super().__init__(engine)
        self.first = threading.Event()
        self.release = threading.Event()
        self.ran: list[str] = []

    def num_workers(self):
        assert self.first.wait(10), "the test never released the call"
        return 1

    def start_weight_update(self):
        self.ran.append("start")
        assert self.release.wait(10), "the test never released the call"

    def update_weights(self, update_info):
        self.ran.append("update")

    def finish_weight_update(self, weight_version=None):
        self.ran.append("finish")


def test_a_call_cancelled_while_the_one_before_runs_never_runs(engine):
    """The worker takes start, update and finish together (they waited behind a call it was
    running); update, cancelled while start runs, never runs, nor finish behind it."""
    client = _SlowStart(engine)
    queue = CallQueue(client)
    busy = queue.submit("num_workers")
    wait_for(busy.future.running, 10, "the first call to run")
    start = queue.submit("start_weight_update")
    update = queue.submit("update_weights", after=start, update_info={})
    finish = queue.submit("finish_weight_update", after=update)
    client.first.set()
    wait_for(lambda: client.ran == ["start"], 10, "start to run")
    update.cancel()  # taken with start, not yet running: it never will
    assert update.future.cancelled()
    client.release.set()
    with pytest.raises(LifecycleError, match="finish_weight_update skipped"):
        finish.result(10)
    start.result(0)
    assert busy.result(0) == 1 and client.ran == ["start"]
    queue.close()
