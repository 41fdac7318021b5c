"""`ReadRecorder`: the box of a checkpoint tensor that loader-like code copies out of a meta
probe, read off the copy source's view geometry; whatever cannot be placed exactly counts
as more (never less) than was read."""

import pytest
import torch
from wtransfer_vllm.recording import ReadRecorder

from wtransfer.records import Box

SHAPE = (10, 6)


def kept(load):
    probe = torch.empty(SHAPE, device="meta", dtype=torch.bfloat16)
    param = torch.nn.Parameter(torch.empty(4, 6, device="meta"))
    recorder = ReadRecorder(probe)
    with torch.no_grad(), recorder:
        load(probe, param)
    return recorder.kept()


def box(rows, cols):
    return Box(offsets=(rows[0], cols[0]), lengths=(rows[1] - rows[0], cols[1] - cols[0]))


@pytest.mark.parametrize(("load", "expected"), [
    # a column-parallel loader: narrow the output dimension, copy
    (lambda w, p: p.data.copy_(w.narrow(0, 3, 4)), box((3, 7), (0, 6))),
    # a fused qkv / gate_up loader: its part of the parameter from a chunk of the tensor
    (lambda w, p: p.data[:, :3].copy_(w.chunk(2, dim=1)[0][3:7]), box((3, 7), (0, 3))),
    (lambda w, p: p.data[:, :3].copy_(w[1:5, 3:6]), box((1, 5), (3, 6))),
    # a cast first, then the narrow: placed through the cast
    (lambda w, p: p.data.copy_(w.to(torch.float32).narrow(0, 5, 4)), box((5, 9), (0, 6))),
    # views that land back in the probe's own order are placed exactly
    (lambda w, p: p.data.copy_(w[2:6].t().t()), box((2, 6), (0, 6))),
    (lambda w, p: p.data.copy_(w.view(60)[0:24].view(4, 6)), box((0, 4), (0, 6))),
    # two reads: the box holding both
    (lambda w, p: (p.data.copy_(w[0:4]), p.data.copy_(w[6:10])), box((0, 10), (0, 6))),
    # order changed (a flip, a transposed copy, a concatenation): all the sources count
    (lambda w, p: p.data.copy_(torch.flip(w[0:8], [0])[0:4]), box((0, 8), (0, 6))),
    (lambda w, p: p.data.copy_(w[2:6, :].t().contiguous().t()), box((0, 10), (0, 6))),
    (lambda w, p: p.data.copy_(torch.cat([w[0:2], w[5:7]])), box((0, 7), (0, 6))),
    # fed into the parameter in place by another op: its source counts
    (lambda w, p: p.data.mul_(w[0:4]), box((0, 4), (0, 6))),
    # a copy of a transposed view, then narrowed: in the transposed order, so all of it
    (lambda w, p: p.data[:, :4].copy_(w[0:6, 0:4].t().contiguous().narrow(1, 0, 4)[:4]),
     box((0, 10), (0, 6))),
    (lambda w, p: p.data.copy_(torch.flip(w, [0]).clone().narrow(0, 0, 4)),
     box((0, 10), (0, 6))),
    # aliases that are not views: .data, detach(), and views made under inference_mode
    (lambda w, p: (p.data[:2].copy_(w[:2]), p.data[2:4].copy_(w.data[6:8])), box((0, 8), (0, 6))),
    (lambda w, p: p.data.copy_(w.detach()[6:10]), box((6, 10), (0, 6))),
    (lambda w, p: p.data.copy_(_inference_view(w)), box((5, 9), (0, 6))),
    # nothing read of the probe (an expert another rank holds, a tied lm_head)
    (lambda w, p: p.data.copy_(torch.zeros(4, 6, device="meta")), None),
])
def test_the_box_a_loader_reads_is_recorded(load, expected):
    assert kept(load) == expected


def _inference_view(w):
    with torch.inference_mode():
        return w[5:9]


def test_no_live_tensor_is_written_while_recording():
    """A loader's in-place ops on a real tensor (a bias that stays live) are not performed."""
    probe = torch.empty(SHAPE, device="meta")
    live = torch.ones(1, 6)
    recorder = ReadRecorder(probe)
    with torch.no_grad(), recorder:
        live.zero_()
        live.copy_(probe[0:1])
    assert torch.equal(live, torch.ones(1, 6))
    assert recorder.kept() == box((0, 1), (0, 6))
