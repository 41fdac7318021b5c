"""A trainer killed mid-transfer: with rollback the engine returns to its last good weights
and version and can resume; without it, /health, /metrics and /weight_info say the weights
are torn until a full update lands."""

import os
import signal

import httpx
import pytest
from engine_helpers import GREEDY, collect, run

from wtransfer.errors import LifecycleError
from wtransfer.fingerprint import fingerprint
from wtransfer.inference import AsyncEngine, EngineConfig
from wtransfer.inference.serving.server import build_app
from wtransfer.launch.models import build
from wtransfer.launch.peer import vary_seed
from wtransfer.launch.processes import spawn_trainer
from wtransfer.shapes import randomize
from wtransfer.testing.conformance import wait_for

SEED = 5


def trainer_weights(version):
    """The fingerprint a --vary trainer's update `version` ("trainer-k") carries."""
    model = build("llm:tiny", seed=SEED, device="cpu")
    step = int(version.rsplit("-", 1)[1])
    if step:
        randomize(model, vary_seed(SEED, step))
    return fingerprint(model.state_dict())


def kill_mid_update(engine, past_bytes=1):
    """Start a looping trainer, let two updates land, SIGKILL it once the third has written
    `past_bytes`; returns the engine's weight info after its watchdog failed the update."""
    trainer = spawn_trainer("ipc", engine.serve_rpc(), model="llm:tiny", seed=SEED, loop=True,
                            vary=True, init_fields={"bucket_bytes": 4096, "timeout_s": 1.0})
    try:
        def open_and_written():
            info = engine.call("weight_info")
            done = info["weight_version"].startswith("trainer-") and \
                int(info["weight_version"].rsplit("-", 1)[1]) >= 2
            return (done and info["update_state"] == "updating"
                    and info["update_bytes"] >= past_bytes)

        wait_for(open_and_written, 30, "an update past its first bucket", interval_s=0.001)
        os.kill(trainer.proc.pid, signal.SIGKILL)
    finally:
        trainer.kill()
        trainer.close()
    return wait_for(lambda: (i := engine.call("weight_info"))["update_state"] == "failed" and i,
                    10, "the watchdog to fail the abandoned update")


@pytest.mark.parametrize("tp", [1, 2])
def test_a_trainer_killed_mid_transfer_rolls_the_engine_back(tp):
    """With TP=2 each worker saved only its own part of each tensor, and wrote it back (the
    trainer is killed past half the model: a worker writes a split tensor once all of it
    arrived, so many have been written)."""
    engine = AsyncEngine(EngineConfig(model="tiny", update_rollback=True, update_staging="off",
                                      tensor_parallel_size=tp))
    try:
        info = kill_mid_update(engine, past_bytes=1 if tp == 1 else 200_000)
        assert info["torn"] is False and "rolled back" in info["failure"]
        # every worker failed it and rolled its part back by the time rank 0 says so
        assert [(w["update_state"], w["torn"]) for w in info["workers"]] == [("failed", False)] * tp
        version = info["weight_version"]
        assert engine.call("fingerprint") == trainer_weights(version)
        assert version == engine.call("get_weight_version")

        async def serve_again():
            await engine.resume_generation()
            out = await collect(engine, "after", [1, 2], GREEDY)
            assert out.outputs[0].weight_versions[0].version == version

        run(serve_again())
    finally:
        engine.shutdown()


def test_without_rollback_the_torn_weights_are_reported_until_a_full_update():
    engine = AsyncEngine(EngineConfig(model="tiny", update_rollback=False,
                                      update_staging="off"))
    app = build_app(engine, dev_mode=True)

    async def probe():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://e") as http:
            return ((await http.get("/health")), (await http.get("/metrics")).text,
                    (await http.get("/weight_info")).json())

    try:
        info = kill_mid_update(engine)
        assert info["torn"] is True and "abandoned" in info["failure"]
        health, metrics, weight_info = run(probe())
        assert health.status_code == 503 and health.json()["status"] == "torn"
        assert "wtransfer_weights_torn 1" in metrics
        assert weight_info["torn"] is True and weight_info["rollback"] is False
        with pytest.raises(LifecycleError, match="failed after changing some weights"):
            run(engine.resume_generation())
        # a complete update heals it
        trainer = spawn_trainer("ipc", engine.serve_rpc(), model="llm:tiny", seed=SEED)
        assert trainer.read_line(60)["event"] == "done"
        trainer.close()
        health, metrics, weight_info = run(probe())
        assert health.status_code == 200 and "wtransfer_weights_torn 0" in metrics
        assert engine.call("fingerprint") == trainer_weights("trainer-0")
        run(engine.resume_generation())
    finally:
        engine.shutdown()
