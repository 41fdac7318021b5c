"""Engine actors on a local Ray cluster (CPU): ipc and nccl(gloo) updates into two actors,
a keep-mode update mid-flight with weight-version spans, an actor killed mid-update."""

import threading
import time

import pytest

ray = pytest.importorskip("ray")

import wtransfer  # noqa: E402
from wtransfer.control.clients import FanoutClient  # noqa: E402
from wtransfer.errors import ConfigError, PeerError, TransferTimeout  # noqa: E402
from wtransfer.inference import load_model  # noqa: E402
from wtransfer.ray import LOCAL_RAY, ActorClient, start_engines, trainer_init_info  # noqa: E402
from wtransfer.shapes import randomize  # noqa: E402
from wtransfer.trainer.source import ModuleSource  # noqa: E402

MODEL = "tiny"
TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}}, _system_config=LOCAL_RAY)
    yield
    ray.shutdown()


def engines(backend, count=2):
    group = start_engines(count, {"model": MODEL, "seed": 0, "weight_transfer_backend": backend,
                                  "batch_invariant": True}, cpus_per_engine=1)
    return group, [ActorClient(h, timeout_s=TIMEOUT_S, name=f"{backend} engine {i}")
                   for i, h in enumerate(group)]


def trainer_model(seed):
    model = load_model(MODEL, seed=0)
    randomize(model, seed)
    return model


@pytest.mark.parametrize("backend", [  # nccl into two actors: the replaced-sender test
    "ipc", pytest.param("nccl", marks=pytest.mark.extended)])
def test_an_update_lands_bit_exact_on_two_engine_actors(cluster, backend):
    group, clients = engines(backend)
    # Ray starts workers at niceness 15; an engine there starves whenever the node is busy
    assert [ray.get(h.niceness.remote()) for h in group] == [0, 0]
    client = FanoutClient(clients)
    model = trainer_model(seed=5)
    before = clients[0].fingerprint()
    info = trainer_init_info(backend, client, bucket_bytes=64 << 10, timeout_s=TIMEOUT_S)
    if backend == "nccl":  # the rendezvous address is the trainer's node as Ray sees it
        assert info.master_address == ray.util.get_node_ip_address()
        assert info.world_size == 3
    with wtransfer.trainer_init(info, client=client, source=ModuleSource(model)) as sender:
        stats = sender.send_weights(weight_version="ray-1")
    assert stats.buckets > 1
    want = wtransfer.fingerprint(model.state_dict())
    assert want != before
    assert [c.fingerprint() for c in clients] == [want, want]
    assert [c.weight_version() for c in clients] == ["ray-1", "ray-1"]
    group.close()


def test_keep_mode_update_mid_flight_splits_the_spans_at_the_pause(cluster):
    group, clients = engines("ipc", count=1)
    (engine,) = clients
    greedy = {"max_tokens": 96, "temperature": 0.0}
    running, finals = [threading.Event() for _ in range(3)], [None, None, None]

    def run(i):
        for out in engine.generate_stream([3 + i, 7, 11], greedy):
            if len(out.outputs[0].token_ids) >= 3:
                running[i].set()
            finals[i] = out

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    assert all(event.wait(TIMEOUT_S) for event in running), "requests made no progress"
    engine.pause("keep", clear_cache=True)
    assert engine.stats()["running"] + engine.stats()["waiting"] == 3  # kept, not aborted
    model = trainer_model(seed=9)
    with wtransfer.trainer_init(trainer_init_info("ipc", engine, timeout_s=TIMEOUT_S),
                                client=engine, source=ModuleSource(model)) as sender:
        sender.send_weights(weight_version="mid")
    engine.resume()
    for t in threads:
        t.join(TIMEOUT_S)
    for final in finals:
        choice = final.outputs[0]
        assert final.finished and len(choice.token_ids) == 96
        spans = choice.weight_versions
        assert [s.version for s in spans] == ["default", "mid"]
        assert spans[0].start == 0 and spans[0].end == spans[1].start and spans[1].end == 96
        assert spans[0].end >= 3
    assert engine.fingerprint() == wtransfer.fingerprint(model.state_dict())
    group.close()


class KillingSource(ModuleSource):
    """Kills an engine actor after the first `after` tensors were read: mid-update."""

    def __init__(self, model, victim, after):
        super().__init__(model)
        self.victim, self.after = victim, after

    def tensors(self):
        for i, item in enumerate(super().tensors()):
            if i == self.after:
                ray.kill(self.victim, no_restart=True)
            yield item


def test_an_actor_killed_mid_update_fails_the_trainer_and_the_other_keeps_its_weights(cluster):
    group, clients = engines("ipc")
    survivor = clients[1]
    before = survivor.fingerprint()
    model = trainer_model(seed=13)
    info = trainer_init_info("ipc", FanoutClient(clients), bucket_bytes=16 << 10,
                             timeout_s=TIMEOUT_S)
    started = time.monotonic()
    with pytest.raises((PeerError, TransferTimeout)) as err, wtransfer.trainer_init(
            info, client=FanoutClient(clients),
            source=KillingSource(model, group[0], after=20)) as sender:
        sender.send_weights(weight_version="never")
    assert time.monotonic() - started < TIMEOUT_S
    assert "ipc engine 0" in str(err.value), str(err.value)
    assert survivor.fingerprint() == before  # rolled back: the old weights, whole
    assert survivor.weight_version() == "default"
    with pytest.raises(PeerError, match="ipc engine 0 died"):
        clients[0].fingerprint()
    # the survivor serves and takes the next update
    assert survivor.generate([1, 2, 3], {"max_tokens": 4}).finished
    with wtransfer.trainer_init(trainer_init_info("ipc", survivor, timeout_s=TIMEOUT_S),
                                client=survivor, source=ModuleSource(model)) as sender:
        sender.send_weights(weight_version="after")
    assert survivor.fingerprint() == wtransfer.fingerprint(model.state_dict())
    group.close()


def test_a_replaced_sender_is_refused_by_two_engine_actors_and_the_new_one_lands(cluster):
    """Two trainer_inits on the same two actors (a restarted trainer over nccl): the first
    sender is refused as replaced, no actor's weights change, the second sender's lands."""
    from wtransfer.errors import SenderReplacedError

    group, clients = engines("nccl")
    client = FanoutClient(clients)
    before = [c.fingerprint() for c in clients]
    old, new = trainer_model(seed=17), trainer_model(seed=18)
    info = trainer_init_info("nccl", client, timeout_s=TIMEOUT_S)
    # the rendezvous address is the trainer's node as Ray sees it
    assert info.master_address == ray.util.get_node_ip_address()
    assert info.world_size == 3
    stale = wtransfer.trainer_init(info, client=client, source=ModuleSource(old))
    current = wtransfer.trainer_init(trainer_init_info("nccl", client, timeout_s=TIMEOUT_S),
                                     client=client, source=ModuleSource(new))
    started = time.monotonic()
    with pytest.raises(SenderReplacedError, match="replaced by a newer trainer_init"):
        stale.send_weights(weight_version="stale")
    assert time.monotonic() - started < TIMEOUT_S / 2
    assert [c.fingerprint() for c in clients] == before
    current.send_weights(weight_version="current")
    want = wtransfer.fingerprint(new.state_dict())
    assert [c.fingerprint() for c in clients] == [want, want]
    assert [c.weight_version() for c in clients] == ["current", "current"]
    stale.shutdown()
    current.shutdown()
    group.close()


def test_an_engine_that_cannot_start_and_an_unknown_call_get_clear_errors(cluster):
    with pytest.raises(ConfigError, match=r"engine actor 0 failed to start.*unknown.*'bogus'"):
        start_engines(1, {"model": MODEL, "weight_transfer_backend": "bogus"}, timeout_s=120)
    group, (engine,) = engines("ipc", count=1)
    with pytest.raises(ConfigError, match="unknown engine actor call 'reboot'"):
        engine.call("reboot")
    with pytest.raises(ConfigError, match="temperature"):  # refused at admission, engine fine
        engine.generate([1, 2], {"temperature": -1.0})
    assert engine.generate([1, 2], {"max_tokens": 2}).finished
    group.close()


def test_the_rl_demo_trains_against_two_engine_actors(cluster, tmp_path, capsys):
    from wtransfer.demos.rl.demo import run_rl_demo

    code = run_rl_demo(steps=2, prompts_per_step=4, group=4, run_dir=str(tmp_path),
                       backend="nccl", ray_engines=2)
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "2 engine actor(s) on Ray" in printed
    assert "mid-flight keep requests checked against a fresh engine: 6, mismatches: 0" in printed
