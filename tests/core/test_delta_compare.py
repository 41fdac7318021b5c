"""The batched comparison against the last-sent copy (`wtransfer.delta.compare.LastSent`):
the same changes as comparing each tensor element by element, whatever the dtypes, sizes,
alignments, groupings and change rates."""

from __future__ import annotations

import os

import pytest
import torch

from wtransfer.delta import compare
from wtransfer.delta.codec import bits, encode_sparse, index_dtype_for
from wtransfer.delta.compare import Change, LastSent
from wtransfer.packing import TensorMeta


def _copy_of(tensors: dict[str, torch.Tensor], device: str = "cpu") -> LastSent:
    last = LastSent([TensorMeta.of(name, t) for name, t in tensors.items()],
                    torch.device(device))
    last.take(tensors.items())
    return last


def _changes(last: LastSent, tensors: dict[str, torch.Tensor], limits: dict[str, int]
             ) -> dict[str, Change]:
    seen = {}
    for name, tensor, change in last.changes(tensors.items(), limits):
        assert tensor is tensors[name]  # handed back as given
        seen[name] = change
    assert sorted(seen) == sorted(tensors)
    return seen


def _tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {"big": torch.randn(1000, 64, generator=gen).bfloat16(),
            "odd": torch.randn(333, generator=gen).bfloat16(),  # not whole 8-byte words
            "f32": torch.randn(40, 40, generator=gen),
            "i64": torch.randint(0, 100, (77,), generator=gen, dtype=torch.int64),
            "bf16": torch.randn(4096, generator=gen).bfloat16(),
            "half": torch.randn(9, generator=gen).half(),
            "bytes": torch.randint(0, 255, (1000,), generator=gen, dtype=torch.uint8),
            "empty": torch.empty(0, dtype=torch.bfloat16),
            "misaligned": torch.randn(1025, generator=gen).bfloat16()[1:],  # 2 bytes in
            "f32 after": torch.randn(512, generator=gen),
            "bf16 after": torch.randn(2048, generator=gen).bfloat16(),
            "strided": torch.randn(64, 32, generator=gen).bfloat16().t()}  # not contiguous


@pytest.mark.parametrize("group_bytes", [64 << 20, 1000])
def test_changes_equal_an_element_by_element_comparison(monkeypatch, group_bytes):
    monkeypatch.setitem(compare.GROUP_BYTES, "cpu", group_bytes)
    tensors = _tensors()
    last = _copy_of(tensors)
    assert last.nbytes == sum(t.numel() * t.element_size() for t in tensors.values())
    gen = torch.Generator().manual_seed(1)
    for fraction in (0.0, 0.001, 0.01, 0.3, 0.9):
        before = {name: t.clone() for name, t in tensors.items()}
        for t in tensors.values():
            t[torch.rand(t.shape, generator=gen) < fraction] += 1
        tensors["bf16"][3] = -0.0 if tensors["bf16"][3] == 0 else tensors["bf16"][3]
        limits = {name: t.numel() // 3 for name, t in tensors.items()}
        changes = _changes(last, tensors, limits)
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
    last = _copy_of({"w": t})
    t[9] = -0.0
    t.view(torch.int16)[7] ^= 1  # another NaN
    change = _changes(last, {"w": t}, {"w": 100})["w"]
    assert change.count == 2 and change.index is not None
    assert change.index.tolist() == [7, 9]


def test_a_tensor_of_another_size_is_refused():
    last = _copy_of({"w": torch.zeros(64)})
    with pytest.raises(ValueError, match="'w': 65 elements of 4 bytes, the copy holds 64"):
        list(last.changes([("w", torch.zeros(65))], {"w": 1}))
    with pytest.raises(ValueError, match="'v': 64 elements of 4 bytes, the copy holds nothing"):
        last.take([("v", torch.zeros(64))])


@pytest.mark.gpu
@pytest.mark.parametrize("group_bytes", [1 << 30, 1000])
def test_changes_on_cuda_equal_those_on_the_host(monkeypatch, group_bytes):
    """Through the Triton kernels (one comparison and one gather per group), in one group
    and in many."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("triton")
    if os.environ.get("WTRANSFER_DELTA_TRITON") == "0":
        pytest.skip("the Triton comparison is turned off (WTRANSFER_DELTA_TRITON=0)")
    assert compare._kernels_for(torch.device("cuda", 0)) is not None  # the kernels run here
    monkeypatch.setitem(compare.GROUP_BYTES, "cuda", group_bytes)
    tensors = _tensors()
    on_gpu = {name: t.cuda() for name, t in tensors.items()}
    host, device = _copy_of(tensors), _copy_of(on_gpu, "cuda")
    gen = torch.Generator().manual_seed(2)
    for fraction in (0.0005, 0.02, 0.5):
        for name, t in tensors.items():
            t[torch.rand(t.shape, generator=gen) < fraction] += 1
            on_gpu[name].copy_(t)
        limits = {name: t.numel() // 2 for name, t in tensors.items()}
        want = _changes(host, tensors, limits)
        got = _changes(device, on_gpu, limits)
        for name in tensors:
            assert got[name].count == want[name].count, (fraction, name)
            assert (got[name].index is None) == (want[name].index is None), (fraction, name)
            if want[name].index is not None:
                assert torch.equal(got[name].index.cpu().long(), want[name].index.long())
                assert torch.equal(got[name].values.cpu(), want[name].values)
            if got[name].payload is not None:  # encoded with the group's other tensors
                assert 0 < want[name].count <= limits[name]
                expected = encode_sparse(want[name].values, want[name].index,
                                         index_dtype_for(tensors[name].numel()))
                assert torch.equal(got[name].payload.cpu(), expected), (fraction, name)
            assert torch.equal(device.view(name).cpu(), host.view(name)), (fraction, name)
        if fraction == 0.02:  # (most tensors changed, all within their limits)
            assert sum(c.payload is not None for c in got.values()) >= 6


@pytest.mark.gpu
def test_a_group_table_is_kept_while_its_tensors_stay_and_rebuilt_when_one_moves():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("triton")
    gen = torch.Generator().manual_seed(3)
    tensors = {f"w{i}": torch.randn(4096 + 64 * i, generator=gen).bfloat16().cuda()
               for i in range(4)}
    last = _copy_of(tensors, "cuda")
    limits = {name: 1 << 20 for name in tensors}
    tensors["w1"][5] += 1
    assert _changes(last, tensors, limits)["w1"].index.tolist() == [5]
    (table,) = last._tables.values()
    tensors["w2"][7] += 1
    _changes(last, tensors, limits)
    assert last._tables[(2, 0)] is table  # kept
    tensors["w3"] = tensors["w3"].clone()  # the same values elsewhere
    tensors["w3"][9] += 1
    changes = _changes(last, tensors, limits)
    assert changes["w3"].index.tolist() == [9] and changes["w2"].count == 0
    assert last._tables[(2, 0)] is not table
    assert last._tables[(2, 0)].ptrs[3] == tensors["w3"].data_ptr()


def test_a_name_that_comes_twice_is_refused():
    tensors = {"a": torch.zeros(64), "b": torch.zeros(64)}
    last = _copy_of(tensors)
    with pytest.raises(ValueError, match="'a' comes twice in one update"):
        list(last.changes([("a", tensors["a"]), ("b", tensors["b"]), ("a", tensors["a"])],
                          {"a": 1, "b": 1}))


def test_a_source_that_skips_a_listed_tensor_is_refused_not_taken_as_unchanged():
    from wtransfer.errors import MetadataError
    from wtransfer.trainer.deltas import DeltaSender
    from wtransfer.trainer.source import ModuleSource

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))

    class Skipping(ModuleSource):
        def tensors(self):
            yield from ((n, t) for n, t in super().tensors() if n != "1.bias")

    sender = DeltaSender()
    source = ModuleSource(model)
    sender.landed(sender.prepare(source))
    with torch.no_grad():
        model[1].bias.add_(1)
    with pytest.raises(MetadataError, match=r"listed \['1.bias'\] \(1 tensors\) but did not"):
        sender.prepare(Skipping(model))
