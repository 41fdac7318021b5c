"""Scheduler and block manager, without torch: batching, prefix cache, preemption, pauses."""

import re

import pytest

from wtransfer.errors import ConfigError
from wtransfer.inference.params import SamplingParams
from wtransfer.inference.steps.block_manager import BlockManager
from wtransfer.inference.steps.scheduler import PauseState, Scheduler
from wtransfer.inference.steps.sequence import SeqStatus, Sequence


def make(num_blocks=64, block_size=4, budget=64, max_seqs=8, prefix=True):
    blocks = BlockManager(num_blocks, block_size, prefix)
    return Scheduler(blocks, max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                     max_model_len=1024), blocks


def step(sched, token=7):
    """Pretend the model ran: each scheduled sequence gets one token."""
    batch = sched.schedule()
    for seq in batch:
        seq.append(token, 0.0, "v")
        seq.num_computed = len(seq) - 1
        sched.blocks.commit(seq)
        if seq.finish_reason:
            sched.finish(seq)
    return batch


def test_scheduler_modules_import_no_torch():
    # the package __init__ pulls torch in through wtransfer; these modules themselves must not
    for mod in ("steps/scheduler", "steps/block_manager", "steps/sequence", "params", "outputs"):
        with open(f"wtransfer/inference/{mod}.py") as f:
            assert not re.search(r"^\s*(import|from)\s+torch\b", f.read(), re.M), mod


def test_continuous_batching_admits_fcfs_under_the_token_budget():
    sched, _ = make(budget=10)
    seqs = [Sequence(f"r{i}", [1, 2, 3, 4], SamplingParams(max_tokens=3)) for i in range(4)]
    for s in seqs:
        sched.add(s)
    first = sched.schedule()
    assert [s.request_id for s in first] == ["r0", "r1"]  # 4 + 4 tokens fit, the third doesn't
    for s in first:
        s.append(9, 0.0, "v")
        s.num_computed = len(s) - 1
    second = sched.schedule()
    # decodes first (2 tokens), then admit FCFS while the budget lasts (4 + 4)
    assert [s.request_id for s in second] == ["r0", "r1", "r2", "r3"]


def test_prefix_cache_reuses_blocks_of_a_shared_prefix():
    sched, blocks = make()
    a = Sequence("a", [*list(range(12)), 50], SamplingParams(max_tokens=1))
    sched.add(a)
    step(sched)
    b = Sequence("b", [*list(range(12)), 60], SamplingParams(max_tokens=1))
    sched.add(b)
    sched.schedule()
    assert blocks.hits == 3 and b.num_computed == 12 and b.num_new == 1
    blocks.reset_prefix_cache()
    c = Sequence("c", [*list(range(12)), 70], SamplingParams(max_tokens=1))
    sched.add(c)
    sched.schedule()
    assert c.num_computed == 0


def test_blocks_generated_one_token_a_step_are_shared_with_a_later_prompt():
    """Decode steps publish each block as it fills (hashing only the new one): a prompt that
    repeats a running sequence's prompt and output hits every full block, also after the
    cache was forgotten and the running sequence filled another block."""
    sched, blocks = make(block_size=4)
    a = Sequence("a", [1, 2, 3, 4, 5], SamplingParams(max_tokens=20))
    sched.add(a)

    def decode(tokens, schedule=True):
        for token in tokens:  # one a step; the scheduler gives the sequence its blocks
            if schedule:
                sched.schedule()
            a.append(token, 0.0, "v")
            a.num_computed = len(a) - 1
            blocks.commit(a)

    decode(range(100, 109))  # 14 tokens: three full blocks
    b = Sequence("b", [*a.tokens[:12], 77], SamplingParams(max_tokens=1))
    sched.add(b)
    sched.schedule()
    assert blocks.hits == 3 and b.block_table[:3] == a.block_table[:3]
    blocks.reset_prefix_cache()
    decode(range(200, 203), schedule=False)  # a's fourth block fills; all four publish
    c = Sequence("c", [*a.tokens[:16], 78], SamplingParams(max_tokens=1))
    sched.add(c)
    sched.schedule()
    assert c.num_computed == 16 and c.block_table[:4] == a.block_table[:4]


def test_running_out_of_blocks_preempts_the_newest_and_recomputes_it():
    sched, blocks = make(num_blocks=4, block_size=4)
    a = Sequence("a", [1, 2, 3, 4, 5, 6, 7], SamplingParams(max_tokens=8))
    b = Sequence("b", [9, 9, 9, 9, 9, 9, 9], SamplingParams(max_tokens=8))
    sched.add(a)
    sched.add(b)
    step(sched)  # both admitted: 2 blocks each, pool full
    step(sched)
    step(sched)  # a reaches 9 tokens and needs a third block: b (newest) is preempted
    assert sched.preemptions >= 1 and b.status is SeqStatus.WAITING and b.num_computed == 0
    while sched.running or sched.waiting:
        step(sched)
    assert a.finish_reason == b.finish_reason == "length"
    assert len(b.output) == 8 and blocks.num_free == 4


def test_pause_states_gate_scheduling():
    sched, _ = make()
    running = Sequence("run", [1, 2], SamplingParams(max_tokens=5))
    sched.add(running)
    step(sched)
    queued = Sequence("new", [3, 4], SamplingParams(max_tokens=5))
    sched.add(queued)
    sched.state = PauseState.PAUSED_NEW
    assert [s.request_id for s in sched.schedule()] == ["run"]
    sched.state = PauseState.PAUSED_ALL
    assert sched.schedule() == [] and not sched.has_work()
    sched.state = PauseState.UNPAUSED
    assert {s.request_id for s in sched.schedule()} == {"run", "new"}


def test_requests_that_could_never_run_are_refused_naming_the_real_ceiling():
    """The first refusal already says how many tokens this prompt can have, and why."""
    sched, _ = make(num_blocks=2, block_size=4, budget=100)
    with pytest.raises(ConfigError, match=r"max_tokens=5 is too many for this 6-token prompt: "
                                          r"at most 2 fit, bounded by the KV cache"):
        sched.add(Sequence("x", [1] * 6, SamplingParams(max_tokens=5)))
    sched.add(Sequence("x", [1] * 6, SamplingParams(max_tokens=2)))  # the ceiling itself fits
    sched2, _ = make(budget=8)
    with pytest.raises(ConfigError, match=r"at most 3 fit, bounded by max_num_batched_tokens"):
        sched2.add(Sequence("y", [1] * 6, SamplingParams(max_tokens=5)))
    with pytest.raises(ConfigError, match=r"max_tokens=100000000 .* at most 3 fit"):
        sched2.add(Sequence("z", [1] * 6, SamplingParams(max_tokens=100_000_000)))
    with pytest.raises(ConfigError, match="the prompt alone fills it"):
        sched2.add(Sequence("w", [1] * 9, SamplingParams(max_tokens=1)))


def test_a_token_slice_equals_slicing_every_token():
    seq = Sequence("s", [1, 2, 3], SamplingParams(max_tokens=10))
    for token in (4, 5, 6):
        seq.append(token, 0.0, "v")
    every = seq.tokens
    assert all(seq.token_slice(a, b) == every[a:b] for a in range(8) for b in range(a, 9))


def test_an_output_snapshot_built_later_is_the_output_as_of_its_step():
    """The engine hands each step's output on as a snapshot that its reader builds later,
    while the engine goes on: the build holds exactly the tokens, logprobs and version spans
    of the snapshot's step, and a final snapshot says why the request ended."""
    seq = Sequence("s", [1, 2], SamplingParams(max_tokens=5))
    for token in (10, 11):
        seq.append(token, -0.5, "v1")
    early = seq.snapshot()
    seq.append(12, -0.25, "v1")
    seq.append(13, -0.125, "v2")
    seq.append(14, -1.0, "v2")  # the fifth token: finish_reason "length"
    seq.status = SeqStatus.FINISHED
    final = seq.snapshot()
    seq.append(15, -2.0, "v2")  # (nothing the final snapshot can see)
    out = early.build()
    assert out.outputs[0].token_ids == [10, 11] and out.outputs[0].logprobs == [-0.5, -0.5]
    assert [(s.version, s.start, s.end) for s in out.outputs[0].weight_versions] == [
        ("v1", 0, 2)]
    assert not out.finished and out.outputs[0].finish_reason is None
    assert out.prompt_token_ids == [1, 2] and out.request_id == "s"
    last = final.build()
    assert last.outputs[0].token_ids == [10, 11, 12, 13, 14]
    assert [(s.version, s.start, s.end) for s in last.outputs[0].weight_versions] == [
        ("v1", 0, 3), ("v2", 3, 5)]
    assert last.finished and last.outputs[0].finish_reason == "length"
    assert seq.to_output().outputs[0].token_ids[-1] == 15
