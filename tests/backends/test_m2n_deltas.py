"""Deltas of M->N transfers over nccl (gloo on CPU) and ucx, real processes: each FSDP2 rank
diffs its own shards, each engine worker receives only the changes inside what it keeps,
and every update is proven to land on the base it names.

What is checked is what a user would notice: the engine's weights equal the trainer's after
every update (fingerprints of the full tensors), a delta moves a small part of the bytes a
full update moves (on the trainer's side and as each worker counted them), a delta the
engine cannot take (it rolled its weights back) is refused and the ranks send that update in
full by themselves, and the transports where deltas cannot be taken say so at init.
"""

import pytest
from m2n_helpers import fields

import wtransfer
from wtransfer.launch.processes import spawn_receiver
from wtransfer.launch.trainer_ranks import TrainerRanks
from wtransfer.trainer.deltas import DENSE_STREAK, FULL_RUN

RANKS = 2


class DeltaCases:
    """The same cases over each backend that moves pair buckets (a class per backend, so the
    suite runs them side by side)."""

    backend: str

    def test_ranks_send_the_changes_of_their_own_shards_into_a_staged_tp_engine(self, serve):
        """Two FSDP2 ranks -> an engine with TP=2 that stages updates (swap): a full update,
        then deltas at 1% changed land bit-exact with each worker taking in a few percent of
        what it keeps; after the engine rolls back (its base gone) the next delta is refused
        before any byte moves and the ranks send it in full; the delta after that lands."""
        engine = serve("--model", "tiny", "--tensor-parallel-size", "2", "--update-staging",
                       "swap", backend=self.backend)
        client = wtransfer.HTTPClient(engine.url)
        with TrainerRanks(RANKS, backend=self.backend, addresses=[engine.url], senders=RANKS,
                          model="llm:tiny", seed=5, updates=4, change_fraction=0.01,
                          gated=True, fingerprint=True,
                          init_fields=fields(self.backend, delta=True)) as trainers:

            def landed(step):
                outs = [trainers.wait_for(r, "sent", 180, count=step + 1) for r in range(RANKS)]
                assert client.fingerprint() == outs[0]["fingerprint"]
                workers = engine.http.get("/weight_info").json()["workers"]
                return outs, workers

            full, workers = landed(0)
            assert all(o["wire_bytes"] == o["sent_bytes"] > 0 for o in full)
            assert all(w["last_update_bytes"] == w["kept_bytes"] for w in workers)
            for step in (1, 2, 3):
                if step == 2:  # back to the weights before the delta: no base any more
                    rolled = engine.http.post("/rollback_weights")
                    assert rolled.status_code == 200, rolled.text
                    assert client.fingerprint() == full[0]["fingerprint"]
                trainers.go()
                outs, workers = landed(step)
                if step == 2:  # refused, then sent in full by the ranks themselves
                    assert all(o["wire_bytes"] == o["sent_bytes"] for o in outs)
                    continue
                assert all(0 < o["wire_bytes"] < 0.1 * o["sent_bytes"] for o in outs)
                assert all(0.005 < o["changed_fraction"] < 0.02 for o in outs)
                assert all(o["delta_base_bytes"] >= o["sent_bytes"] for o in outs)
                assert all(0 < w["last_update_bytes"] < 0.1 * w["kept_bytes"]
                           for w in workers)
                assert sum(w["last_update_bytes"] for w in workers) == sum(
                    o["wire_bytes"] for o in outs)  # what moved is what the workers counted
            assert trainers.wait(60) == [0] * RANKS


    def test_ranks_whose_deltas_turn_dense_send_runs_of_whole_buckets_then_compare_again(
            self, serve):
        """Most elements change every step (a high learning rate): after `DENSE_STREAK` dense
        deltas each rank sends `FULL_RUN` updates with every bucket whole, comparing nothing
        (no changed fraction); the run's last keeps what it sent, so the delta after the run,
        of unchanged weights, is compared against it and moves nothing. Every update lands
        bit-exact."""
        engine = serve("--model", "tiny", "--tensor-parallel-size", "2", backend=self.backend)
        client = wtransfer.HTTPClient(engine.url)
        dense = DENSE_STREAK + FULL_RUN
        fractions = []
        with TrainerRanks(RANKS, backend=self.backend, addresses=[engine.url], senders=RANKS,
                          model="llm:tiny", seed=5, updates=dense + 2,
                          change_fraction=[0.9] * dense + [0.0], gated=True, fingerprint=True,
                          init_fields=fields(self.backend, delta=True)) as trainers:
            for step in range(dense + 2):
                if step:
                    trainers.go()
                outs = [trainers.wait_for(r, "sent", 180, count=step + 1) for r in range(RANKS)]
                assert client.fingerprint() == outs[0]["fingerprint"], step
                if step <= dense:  # every byte goes, whole (a bucket's padding counted)
                    assert all(o["wire_bytes"] >= o["sent_bytes"] for o in outs), step
                compared = {o.get("changed_fraction") is not None for o in outs}
                assert len(compared) == 1, step  # (the ranks decide alike on alike changes)
                fractions.append(compared.pop())
            assert trainers.wait(60) == [0] * RANKS
        assert fractions == ([False] + [True] * DENSE_STREAK + [False] * FULL_RUN + [True])
        assert all(o["wire_bytes"] == 0 and o["changed_fraction"] == 0 for o in outs)


class TestNccl(DeltaCases):
    backend = "nccl"


@pytest.mark.extended  # the same pair-bucket deltas as nccl's, through ucx's tagged sends
class TestUcx(DeltaCases):
    backend = "ucx"


@pytest.mark.parametrize(("backend", "senders", "m2n", "error"), [
    ("ipc", RANKS, True, "ipc M->N shares each staged box"),
    ("nccl", 1, False, "needs an M->N transfer, where each rank diffs its own shards"),
])
def test_deltas_where_ranks_do_not_send_their_own_pair_buckets_are_refused_at_init(
        backend, senders, m2n, error):
    """Shared-memory staging (ipc M->N) gains nothing from a delta, and a rank that gathers
    others' shards holds no copy of them to diff: both are refused by trainer_init on every
    rank, saying what to change."""
    with spawn_receiver(backend, model="mixed", seed=2) as receiver, TrainerRanks(
            RANKS, backend=backend, addresses=[receiver.address], senders=senders,
            init_fields=fields(backend, delta=True, m2n=m2n), timeout_s=30.0) as trainers:
        assert trainers.wait(90) == [1] * RANKS
        said = [trainers.stderr(r) for r in range(RANKS)]
        assert all("ConfigError: delta=True" in text and error in text for text in said)
