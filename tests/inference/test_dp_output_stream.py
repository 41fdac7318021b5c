"""Outputs between a data-parallel rank and its front end (`wtransfer.inference.dp.
output_stream`): each step's entry carries only the new tokens, and the front end's outputs
equal the rank's cumulative ones, step by step, through the wire's encoding."""

import pytest

from wtransfer import wire
from wtransfer.inference.dp.output_stream import FrontEndOutputs, RankOutputs
from wtransfer.inference.params import SamplingParams
from wtransfer.inference.steps.sequence import SeqStatus, Sequence


def test_each_step_sends_its_new_tokens_and_the_front_end_rebuilds_every_output():
    rank, front = RankOutputs(), FrontEndOutputs()
    seq = Sequence("r", [3, 4], SamplingParams(max_tokens=6))
    for step, token in enumerate([7, 8, 9, 10, 11, 12]):
        seq.append(token, -0.5 * step, "v1" if step < 3 else "v2")
        if seq.finish_reason is not None:
            seq.status = SeqStatus.FINISHED
        data = wire.decode(wire.encode(rank.entry(seq.snapshot())))
        assert data["token_ids"] == [token]  # only what is new
        got = front.take(data, [3, 4]).build()
        assert got == seq.to_output(), step
    assert got.finished and got.outputs[0].finish_reason == "length"
    assert [(s.version, s.start, s.end) for s in got.outputs[0].weight_versions] == [
        ("v1", 0, 3), ("v2", 3, 6)]


def test_a_whole_output_replaces_the_front_ends_copy():
    rank, front = RankOutputs(), FrontEndOutputs()
    seq = Sequence("r", [1], SamplingParams(max_tokens=9))
    seq.append(5, -1.0, "v")
    front.take(wire.decode(wire.encode(rank.entry(seq.snapshot()))), [1])
    seq.finish_reason, seq.error, seq.status = "error", "boom", SeqStatus.FINISHED
    got = front.take(wire.decode(wire.encode(rank.entry(seq.to_output()))), [1])
    assert got == seq.to_output() and got.outputs[0].error == "boom"
    again = Sequence("r", [1], SamplingParams(max_tokens=9))  # (the id reused later)
    again.append(6, -2.0, "v")
    data = wire.decode(wire.encode(rank.entry(again.snapshot())))
    assert data["from"] == 0 and front.take(data, [1]).build() == again.to_output()


def test_a_request_whose_rank_died_ends_with_every_token_the_front_end_holds():
    rank, front = RankOutputs(), FrontEndOutputs()
    seq = Sequence("r", [1, 2], SamplingParams(max_tokens=9))
    for token in (5, 6):
        seq.append(token, -1.0, "v")
        front.take(wire.decode(wire.encode(rank.entry(seq.snapshot()))), None)
    last = front.end("r", [1, 2], "rank 1 died")
    assert last.finished and last.prompt_token_ids == [1, 2]
    assert last.outputs[0].token_ids == [5, 6] and last.outputs[0].error == "rank 1 died"
    assert last.outputs[0].finish_reason == "error"
    assert front.end("other", [3], "rank 1 died").outputs[0].token_ids == []


def test_tokens_that_do_not_follow_what_the_front_end_holds_are_refused():
    rank, front = RankOutputs(), FrontEndOutputs()
    seq = Sequence("r", [1], SamplingParams(max_tokens=9))
    seq.append(5, -1.0, "v")
    front.take(rank.entry(seq.snapshot()), [1])
    seq.append(6, -1.0, "v")
    entry = rank.entry(seq.snapshot())
    entry["from"] = 0  # (as if the first message had been lost)
    with pytest.raises(ValueError, match="a rank sent tokens from 0, the front end holds 1"):
        front.take(entry, [1])
