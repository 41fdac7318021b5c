"""A fleet of `wtransfer serve` instances updated as one (`FanoutClient`): all or nothing by
default, dropping dead instances on request, and growing while training. Real servers in
child processes, one SIGKILLed mid-update, over ipc and nccl (gloo)."""

import os
import signal
import time

import pytest
from test_http import KEY, Server
from wtransfer_ipc import IPCTrainerInitInfo
from wtransfer_nccl import NCCLTrainerInitInfo
from wtransfer_ucx import UCXTrainerInitInfo

import wtransfer
from wtransfer.errors import WTransferError
from wtransfer.inference.model.decoder import load_model

BACKENDS = ["ipc", "nccl"]
BACKENDS_NCCL_EXTENDED = ["ipc", pytest.param("nccl", marks=pytest.mark.extended)]
"""Checks whose nccl run repeats the ipc one through the same fleet code (`make test-extended`
runs it; the nccl group's re-forming is checked in make test by the drop and kill cases)."""


def info(backend, timeout_s=10.0):
    if backend == "nccl":
        return NCCLTrainerInitInfo(master_address="127.0.0.1", bucket_bytes=1 << 14,
                                   timeout_s=timeout_s)
    if backend == "ucx":
        return UCXTrainerInitInfo(listen_address="127.0.0.1", bucket_bytes=1 << 14,
                                  timeout_s=timeout_s)
    return IPCTrainerInitInfo(bucket_bytes=1 << 14, timeout_s=timeout_s)


def serve(backend):
    return Server("--dev-mode", "--weight-transfer-backend", backend, "--batch-invariant")


class KillingSource(wtransfer.ModuleSource):
    """The trainer's tensors; after `after` of them, `server` is SIGKILLed (an instance
    dying mid-update: the source is read while the update is open)."""

    def __init__(self, model, server, after=6):
        super().__init__(model)
        self.server, self.after = server, after

    def held(self):
        return None  # (every path reads the tensors through `tensors`, M->N plans included)

    def tensors(self):
        for index, item in enumerate(super().tensors()):
            if index == self.after and self.server.proc.poll() is None:
                os.kill(self.server.proc.pid, signal.SIGKILL)
                self.server.proc.wait(10)
            yield item


def greedy(server):
    body = {"token_ids": [3, 4, 5], "sampling_params": {"max_tokens": 6, "temperature": 0}}
    reply = server.http.post("/inference/v1/generate", json=body)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]


@pytest.mark.parametrize("backend", BACKENDS_NCCL_EXTENDED)
def test_all_or_nothing_an_instance_killed_mid_update_leaves_the_other_as_it_was(backend):
    """Default fleet: one instance dies mid-update, so none commits: the survivor keeps its
    fingerprint and version and serves; the error names the dead instance; the next update,
    to a fleet of the survivor alone, lands."""
    survivor, doomed = serve(backend), serve(backend)
    try:
        clients = [wtransfer.HTTPClient(s.url) for s in (survivor, doomed)]
        fleet = wtransfer.FanoutClient(clients)
        before = clients[0].fingerprint()
        trainer = load_model("tiny", seed=7)
        start = time.monotonic()
        with pytest.raises(WTransferError) as err, \
                wtransfer.trainer_init(info(backend), client=fleet,
                                       source=KillingSource(trainer, doomed)) as sender:
            sender.send_weights(weight_version="v1")
        assert time.monotonic() - start < 60  # within the deadlines
        assert repr(clients[1]) in str(err.value)
        assert clients[0].fingerprint() == before
        assert survivor.http.get("/weight_info").json()["weight_version"] == "default"
        assert greedy(survivor)["weight_versions"][0]["version"] == "default"
        with wtransfer.trainer_init(info(backend), client=wtransfer.FanoutClient(clients[:1]),
                                    source=wtransfer.ModuleSource(trainer)) as sender:
            sender.send_weights(weight_version="v2")
        assert clients[0].fingerprint() == wtransfer.fingerprint(trainer.state_dict())
    finally:
        survivor.stop()
        doomed.stop()


class TestDropMode:
    """A fleet that drops a dead instance (a scope of its own: it runs beside the other fleet
    tests)."""

    @pytest.mark.parametrize("backend", [*BACKENDS_NCCL_EXTENDED, "ucx"])
    def test_drop_mode_lands_the_update_on_the_survivors_and_names_the_dropped(self,
                                                                               backend):
        """`on_failure="drop"`: the dead instance leaves the fleet, the update lands on the other
        (nccl, ucx: the sender connects again to the survivor, planned afresh: ucx's 1->N plan of
        two instances becomes one worker's, and the update is sent again), and
        `TransferStats.dropped` names it; the next update goes to the survivor."""
        survivor, doomed = serve(backend), serve(backend)
        try:
            clients = [wtransfer.HTTPClient(s.url) for s in (survivor, doomed)]
            fleet = wtransfer.FanoutClient(clients, on_failure="drop")
            trainer = load_model("tiny", seed=8)
            with wtransfer.trainer_init(info(backend), client=fleet,
                                        source=KillingSource(trainer, doomed)) as sender:
                stats = sender.send_weights(weight_version="v1")
                assert stats.dropped == [repr(clients[1])]
                assert fleet.clients == clients[:1]
                assert clients[0].fingerprint() == wtransfer.fingerprint(trainer.state_dict())
                assert greedy(survivor)["weight_versions"][0]["version"] == "v1"
                trainer = load_model("tiny", seed=9)
                sender.source = wtransfer.ModuleSource(trainer)
                stats = sender.send_weights(weight_version="v2")
                assert stats.dropped == []
            assert clients[0].fingerprint() == wtransfer.fingerprint(trainer.state_dict())
        finally:
            survivor.stop()
            doomed.stop()


@pytest.mark.parametrize("backend", BACKENDS_NCCL_EXTENDED)
def test_an_instance_added_while_training_gets_the_next_update(backend):
    first, second = serve(backend), serve(backend)
    try:
        fleet = wtransfer.FanoutClient([wtransfer.HTTPClient(first.url)])
        trainer = load_model("tiny", seed=10)
        with wtransfer.trainer_init(info(backend), client=fleet,
                                    source=wtransfer.ModuleSource(trainer)) as sender:
            sender.send_weights(weight_version="v1")
            joined = wtransfer.HTTPClient(second.url)
            fleet.add(joined)
            assert joined.fingerprint() != wtransfer.fingerprint(trainer.state_dict())
            sender.send_weights(weight_version="v2")
        assert joined.fingerprint() == fleet.fingerprint() == \
            wtransfer.fingerprint(trainer.state_dict())
        assert second.http.get("/weight_info").json()["weight_version"] == "v2"
    finally:
        first.stop()
        second.stop()


def test_a_fleet_stages_every_instance_before_any_commits():
    """One instance fails at the finish's first phase (staging: here its client raises, as
    an instance that dies or refuses there would): the other instance, which staged the
    update, discards it, so nothing goes live anywhere; no instance was asked to commit."""
    from wtransfer.inference import AsyncEngine, EngineConfig, LocalEngineClient

    engines = [AsyncEngine(EngineConfig(model="tiny", update_staging="swap"))
               for _ in range(2)]
    events = []

    class Watching(LocalEngineClient):
        def __init__(self, engine, name, fails=False):
            super().__init__(engine)
            self.name, self.fails = name, fails

        def stage_weight_update(self):
            events.append(("stage", self.name))
            if self.fails:
                raise WTransferError(f"{self.name} failed while staging")
            super().stage_weight_update()

        def discard_weight_update(self, reason):
            events.append(("discard", self.name))
            super().discard_weight_update(reason)

        def finish_weight_update(self, weight_version=None):
            events.append(("finish", self.name))
            super().finish_weight_update(weight_version)

        def __repr__(self):
            return self.name

    try:
        clients = [Watching(engines[0], "good"), Watching(engines[1], "bad", fails=True)]
        before = [c.fingerprint() for c in clients]
        trainer = load_model("tiny", seed=11)
        with pytest.raises(WTransferError, match=r"1 of 2 instance\(s\) failed: bad"), \
                wtransfer.trainer_init(IPCTrainerInitInfo(bucket_bytes=1 << 14),
                                       client=wtransfer.FanoutClient(clients),
                                       source=wtransfer.ModuleSource(trainer)) as sender:
            sender.send_weights(weight_version="v1")
        assert sorted(events) == [("discard", "good"), ("stage", "bad"), ("stage", "good")]
        assert [c.fingerprint() for c in clients] == before
        assert [c.weight_version for c in clients] == ["default", "default"]
        with wtransfer.trainer_init(IPCTrainerInitInfo(bucket_bytes=1 << 14),
                                    client=wtransfer.FanoutClient(clients[:1]),
                                    source=wtransfer.ModuleSource(trainer)) as sender:
            sender.send_weights(weight_version="v2")  # the good one takes the next update
        assert clients[0].fingerprint() == wtransfer.fingerprint(trainer.state_dict())
    finally:
        for engine in engines:
            engine.shutdown()


@pytest.mark.parametrize("backend", BACKENDS_NCCL_EXTENDED)
def test_a_new_instance_joins_from_a_peer_with_its_weights_and_version(backend):
    """`wtransfer serve --weights-from URL`: a new instance starts with a running peer's
    weights (fingerprints equal) and version, copied engine to engine with no trainer, and
    serves them; the peer's API key guards the copy."""
    peer = Server("--dev-mode", "--weight-transfer-backend", backend, "--batch-invariant",
                  "--api-key", KEY)
    joiner = None
    try:
        trainer = load_model("tiny", seed=12)
        client = wtransfer.HTTPClient(peer.url, api_key=KEY)
        with wtransfer.trainer_init(info(backend), client=client,
                                    source=wtransfer.ModuleSource(trainer)) as sender:
            sender.send_weights(weight_version="step-12")
        joiner = Server("--dev-mode", "--weight-transfer-backend", backend, "--batch-invariant",
                        "--weights-from", peer.url, "--peer-api-key", KEY)
        assert "joined from" in joiner.output() and "'step-12'" in joiner.output()
        joined = wtransfer.HTTPClient(joiner.url)
        assert joined.fingerprint() == client.fingerprint() == \
            wtransfer.fingerprint(trainer.state_dict())
        assert joiner.http.get("/weight_info").json()["weight_version"] == "step-12"
        assert greedy(joiner) == greedy(peer)
    finally:
        peer.stop()
        if joiner is not None:
            joiner.stop()


def test_joining_from_a_peer_that_refuses_or_is_gone_fails_before_serving(tmp_path):
    """A wrong key, or no peer at all: `wtransfer serve --weights-from` exits with one line
    naming what failed, and never serves."""
    import subprocess
    import sys

    from wtransfer.launch.processes import free_port

    peer = Server("--dev-mode", "--api-key", KEY)
    try:
        for url, says in ((peer.url, "401"), (f"http://127.0.0.1:{free_port()}",
                                               "cannot reach the server")):
            out = subprocess.run([sys.executable, "-m", "wtransfer", "serve", "--model", "tiny",
                                  "--port", "0", "--weights-from", url],
                                 capture_output=True, text=True, timeout=120)
            assert out.returncode == 2, out.stdout + out.stderr
            assert says in out.stderr and "Traceback" not in out.stderr, out.stderr
            assert "joined from" not in out.stdout
    finally:
        peer.stop()
