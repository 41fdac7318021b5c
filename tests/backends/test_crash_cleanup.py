"""Either side SIGKILLed at random points of init, update and finish leaves no shared memory
behind and the next sender lands bit-exact weights; a frozen peer fails the trainer within
its deadline (+10%)."""

import os
import random
import signal
import subprocess
import sys
import threading
import time

import pytest
from wtransfer_ipc import IPCTrainerInitInfo
from wtransfer_ipc.shm import SHM_DIR, creator_alive

import wtransfer
from wtransfer.errors import TransferTimeout
from wtransfer.fingerprint import fingerprint
from wtransfer.launch.models import build
from wtransfer.launch.processes import free_port, spawn_receiver, spawn_trainer
from wtransfer.testing.conformance import wait_for

ROUNDS = 4
INIT = {"bucket_bytes": 64 << 10, "timeout_s": 2.0}


def segments():
    return sorted(n for n in os.listdir(SHM_DIR) if n.startswith("wtransfer_"))


def orphans():
    return [n for n in segments() if not creator_alive(n)]


def land_final_update(address, seed):
    """A trainer that runs to the end; returns the fingerprint it sent."""
    with spawn_trainer("ipc", address, model="mixed", seed=seed, init_fields=INIT) as trainer:
        assert trainer.read_line(60)["event"] == "done"
    return fingerprint(build("mixed", seed, "cpu").state_dict())


def mapped_segments(pid):
    """The wtransfer shared-memory segments process `pid` maps."""
    with open(f"/proc/{pid}/maps") as maps:
        return {line.split()[-2] if line.rstrip().endswith("(deleted)") else line.split()[-1]
                for line in maps if f"{SHM_DIR}/wtransfer_" in line}


def test_a_receiver_unmaps_a_dead_trainers_staging_and_takes_the_next_sender():
    """Once its trainer's process is gone, a receiver drops its mappings of that trainer's
    staging within a few seconds (they would hold the memory until the next sender's init;
    on a GPU, a restarted trainer could not allocate its model); an update call of the dead
    sender that arrives later is refused saying why, and a new sender lands bit-exact."""
    with spawn_receiver("ipc", model="mixed", seed=2) as receiver:
        trainer = spawn_trainer("ipc", receiver.address, model="mixed", seed=5, loop=True,
                                init_fields=INIT)
        assert trainer.info["event"] == "sending"  # (its init reached the receiver)
        assert mapped_segments(receiver.proc.pid), "the receiver maps the trainer's staging"
        trainer.kill()
        trainer.close()
        wait_for(lambda: not mapped_segments(receiver.proc.pid), 15,
                 "the receiver to unmap the dead trainer's staging")
        late = wtransfer.rpc.RPCClient(receiver.address, timeout_s=30)
        with pytest.raises(wtransfer.errors.PeerError, match="unmapped its memory"):
            late.start_weight_update()
        late.close()
        sent = land_final_update(receiver.address, seed=99)
        client = wtransfer.rpc.RPCClient(receiver.address, timeout_s=30)
        assert client.fingerprint() == sent
        client.close()


def test_trainers_killed_at_random_points_leave_no_segments_and_the_next_one_lands():
    rng = random.Random(19)
    with spawn_receiver("ipc", model="mixed", seed=2) as receiver:
        client = wtransfer.rpc.RPCClient(receiver.address, timeout_s=30)
        for i in range(ROUNDS):
            trainer = spawn_trainer("ipc", receiver.address, model="mixed", seed=10 + i,
                                    loop=True, init_fields=INIT)
            time.sleep(rng.uniform(0, 0.4))  # somewhere in init, an update, or a finish
            trainer.kill()
            trainer.close()
        sent = land_final_update(receiver.address, seed=99)
        assert orphans() == [], "segments of killed trainers were left behind"
        wait_for(lambda: client.status()["state"] == "ready", 30, "the receiver to be ready")
        assert client.fingerprint() == sent
        client.close()


def test_receivers_or_both_sides_killed_leave_no_segments():
    rng = random.Random(23)
    for i in range(ROUNDS // 2):
        receiver = spawn_receiver("ipc", model="mixed", seed=2)
        trainer = spawn_trainer("ipc", receiver.address, model="mixed", seed=30 + i,
                                loop=True, init_fields=INIT)
        time.sleep(rng.uniform(0, 0.4))
        receiver.kill()
        if i % 2:  # both sides die
            trainer.kill()
        else:  # the trainer notices its receiver is gone and exits with the error
            assert trainer.proc.wait(timeout=INIT["timeout_s"] * 3 + 10) != 0
        trainer.close()
        receiver.close()
    with spawn_receiver("ipc", model="mixed", seed=2) as receiver:
        sent = land_final_update(receiver.address, seed=77)
        assert orphans() == []
        client = wtransfer.rpc.RPCClient(receiver.address, timeout_s=30)
        assert client.fingerprint() == sent
        client.close()


def send_until_it_fails(client, freeze):
    """Send in a loop on this thread; `freeze()` the peer mid-transfer from another thread;
    return (error, seconds from the freeze to the error)."""
    model = build("mixed", 3, "cpu")
    sender = wtransfer.trainer_init(IPCTrainerInitInfo(bucket_bytes=64 << 10, timeout_s=3.0),
                                    client=client, source=wtransfer.ModuleSource(model))
    frozen_at = []
    threading.Timer(0.3, lambda: (freeze(), frozen_at.append(time.monotonic()))).start()
    try:
        for _ in range(100_000):
            sender.send_weights()
    except Exception as exc:
        return exc, time.monotonic() - frozen_at[0]
    finally:
        sender.shutdown()
    raise AssertionError("the transfer never failed")


def test_a_frozen_rpc_receiver_fails_the_trainer_within_its_deadline():
    with spawn_receiver("ipc", model="mixed", seed=2) as receiver:
        client = wtransfer.rpc.RPCClient(receiver.address, timeout_s=3.0)
        try:
            error, seconds = send_until_it_fails(
                client, lambda: os.kill(receiver.proc.pid, signal.SIGSTOP))
        finally:
            os.kill(receiver.proc.pid, signal.SIGCONT)
        assert isinstance(error, TransferTimeout), error
        assert seconds <= 3.0 * 1.1, f"failed {seconds:.2f}s after the freeze (deadline 3s)"


@pytest.fixture
def frozen_server():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "wtransfer", "serve", "--port", str(port),
                             "--dev-mode", "--model", "tiny"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    client = wtransfer.HTTPClient(url, timeout_s=3.0)

    def up():
        try:
            return client.is_paused() is False
        except wtransfer.errors.WTransferError:
            return False

    wait_for(up, 60, "the server to start")
    yield proc, client
    os.kill(proc.pid, signal.SIGCONT)
    proc.terminate()
    proc.wait(timeout=30)


def test_a_frozen_http_server_fails_the_trainer_within_its_deadline(frozen_server):
    proc, client = frozen_server
    client.pause("keep")
    sender_model = "llm:tiny"
    model = build(sender_model, 4, "cpu")
    sender = wtransfer.trainer_init(IPCTrainerInitInfo(bucket_bytes=4096, timeout_s=3.0),
                                    client=client, source=wtransfer.ModuleSource(model))
    frozen_at = []
    threading.Timer(0.3, lambda: (os.kill(proc.pid, signal.SIGSTOP),
                                  frozen_at.append(time.monotonic()))).start()
    with pytest.raises(TransferTimeout):
        for _ in range(100_000):
            sender.send_weights()
    seconds = time.monotonic() - frozen_at[0]
    sender.shutdown()
    assert seconds <= 3.0 * 1.1, f"failed {seconds:.2f}s after the freeze (deadline 3s)"


def test_a_segment_whose_creator_is_gone_is_swept_when_a_sender_starts():
    from wtransfer_ipc.sender_process import start_time
    from wtransfer_ipc.shm import SharedBuffer

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    start = start_time(dead.pid)
    dead.wait()
    leaked = os.path.join(SHM_DIR, f"wtransfer_{dead.pid}_{start or 1}_{'ab' * 8}_0")
    with open(leaked, "wb") as f:
        f.write(b"\0" * 4096)
    mine = f"wtransfer_{os.getpid()}_{start_time(os.getpid())}_{'cd' * 8}_0"
    alive = SharedBuffer(mine, 4096, create=True)  # a live creator's segment stays
    try:
        made = SharedBuffer.create_set(1, 4096)
        assert not os.path.exists(leaked)
        assert os.path.exists(alive.path)
        for buf in made:
            buf.close()
    finally:
        alive.close()
