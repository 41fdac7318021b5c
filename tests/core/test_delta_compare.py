"""The batched comparison against the last-sent copy (`wtransfer.delta.compare.LastSent`):
the same changes as comparing each tensor element by element, whatever the dtypes, sizes,
alignments, groupings and change rates."""

from __future__ import annotations

import pytest
import torch

from wtransfer.delta import compare
from wtransfer.delta.codec import bits
from wtransfer.delta.compare import LastSent


def _tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {"big": torch.randn(1000, 64, generator=gen).bfloat16(),
            "odd": torch.randn(333, generator=gen).bfloat16(),  # not whole 8-byte words
            "f32": torch.randn(40, 40, generator=gen),
            "i64": torch.randint(0, 100, (77,), generator=gen, dtype=torch.int64),
            "bf16": torch.randn(4096, generator=gen).bfloat16(),
            "half": torch.randn(9, generator=gen).half(),
            "bytes": torch.randint(0, 255, (1000,), generator=gen, dtype=torch.uint8),
            "strided": torch.randn(64, 32, generator=gen).bfloat16().t()}  # not contiguous


@pytest.mark.parametrize("group_bytes", [64 << 20, 1000])
def test_changes_equal_an_element_by_element_comparison(monkeypatch, group_bytes):
    monkeypatch.setitem(compare.GROUP_BYTES, "cpu", group_bytes)
    tensors = _tensors()
    last = LastSent(tensors.items(), torch.device("cpu"))
    assert last.nbytes == sum(t.numel() * t.element_size() for t in tensors.values())
    gen = torch.Generator().manual_seed(1)
    for fraction in (0.0, 0.001, 0.01, 0.3, 0.9):
        before = {name: t.clone() for name, t in tensors.items()}
        for t in tensors.values():
            t[torch.rand(t.shape, generator=gen) < fraction] += 1
        tensors["bf16"][3] = -0.0 if tensors["bf16"][3] == 0 else tensors["bf16"][3]
        limits = {name: t.numel() // 3 for name, t in tensors.items()}
        changes = last.changes(list(tensors.items()), limits)
        for name, t in tensors.items():
            want = torch.nonzero(bits(t) != bits(before[name])).squeeze(1)
            change = changes[name]
            assert change.count == want.numel(), (fraction, name)
            if change.index is None:  # only past the limit may indices be left out
                assert change.count > limits[name]
            else:
                assert torch.equal(change.index.long(), want), (fraction, name)
                assert change.values is not None
                assert torch.equal(change.values, bits(t)[want]), (fraction, name)
            assert torch.equal(last.view(name), bits(t)), (fraction, name)  # copy is current


def test_a_bit_change_that_keeps_the_value_counts():
    """-0.0 against 0.0, and a NaN payload: equal or unordered values, different bits."""
    t = torch.zeros(4096, dtype=torch.bfloat16)
    t[7] = float("nan")
    last = LastSent([("w", t)], torch.device("cpu"))
    t[9] = -0.0
    t.view(torch.int16)[7] ^= 1  # another NaN
    change = last.changes([("w", t)], {"w": 100})["w"]
    assert change.count == 2 and change.index is not None
    assert change.index.tolist() == [7, 9]


def test_a_tensor_of_another_size_is_refused():
    last = LastSent([("w", torch.zeros(64))], torch.device("cpu"))
    with pytest.raises(ValueError, match="'w': 65 elements, the copy holds 64"):
        last.changes([("w", torch.zeros(65))], {"w": 1})


@pytest.mark.gpu
def test_changes_on_cuda_equal_those_on_the_host():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    tensors = _tensors()
    on_gpu = {name: t.cuda() for name, t in tensors.items()}
    host = LastSent(tensors.items(), torch.device("cpu"))
    device = LastSent(on_gpu.items(), torch.device("cuda"))
    gen = torch.Generator().manual_seed(2)
    for fraction in (0.0005, 0.02, 0.5):
        for name, t in tensors.items():
            t[torch.rand(t.shape, generator=gen) < fraction] += 1
            on_gpu[name].copy_(t)
        limits = {name: t.numel() // 2 for name, t in tensors.items()}
        want = host.changes(list(tensors.items()), limits)
        got = device.changes(list(on_gpu.items()), limits)
        for name in tensors:
            assert got[name].count == want[name].count
            if want[name].index is not None and got[name].index is not None:
                assert torch.equal(got[name].index.cpu().long(), want[name].index.long())
