"""The sampled estimate of a delta's size (`wtransfer.delta.estimate`): which elements it
reads, and that it tells a dense delta from a sparse one, close to the bytes a delta moves."""

import torch

from wtransfer.delta import estimate
from wtransfer.delta.codec import index_dtype_for, sparse_limit, sparse_nbytes
from wtransfer.delta.estimate import (
    RUN,
    SAMPLE_EVERY,
    Sample,
    copied_in_groups,
    predicted_moved,
    sampled,
)
from wtransfer.packing import TensorMeta


def test_the_sample_is_one_run_in_every_period_or_a_whole_short_tensor():
    period = RUN * SAMPLE_EVERY
    flat = torch.arange(3 * period + 5)
    runs = sampled(flat)
    assert runs.shape == (3, RUN)
    assert torch.equal(runs[2], torch.arange(2 * period, 2 * period + RUN))
    short = torch.arange(period - 1)
    assert sampled(short) is short


def test_the_estimate_tells_dense_from_sparse_close_to_the_bytes_a_delta_moves():
    generator = torch.Generator().manual_seed(0)
    before = torch.randn(1 << 21, generator=generator).to(torch.bfloat16)
    norm = torch.randn(1000, generator=generator)  # shorter than a period: read whole
    metas = [TensorMeta.of("w", before), TensorMeta.of("norm", norm)]
    limits = {m.name: sparse_limit(m.numel, index_dtype_for(m.numel), m.itemsize)
              for m in metas}
    sample = Sample(metas, [before, norm], torch.device("cpu"))

    def moved(fraction):
        now = before.clone()
        changed = torch.rand(now.numel(), generator=generator) < fraction
        now[changed] += 1
        norm_now = norm.clone()
        norm_now[:10] += 1
        return predicted_moved(metas, [now, norm_now], sample.of, limits), int(changed.sum())

    assert predicted_moved(metas, [before, norm], sample.of, limits) == 0
    dense, _ = moved(0.3)  # past the sparse limit (1/6 of bf16 elements): goes whole
    assert dense == metas[0].nbytes + sparse_nbytes(10, "uint16", 4)
    sparse, count = moved(0.005)
    true = sparse_nbytes(count, "int32", 2) + sparse_nbytes(10, "uint16", 4)
    assert 0.8 * true < sparse < 1.2 * true


def test_tensors_copied_in_groups_come_back_bit_exact_whatever_their_dtypes_and_lengths(
        monkeypatch):
    monkeypatch.setattr(estimate, "GROUP_BYTES", 100)  # (several groups, several per group)
    generator = torch.Generator().manual_seed(1)
    named = [(f"t{i}", torch.randint(-1000, 1000, (length,), generator=generator).to(dtype))
             for i, (length, dtype) in enumerate([(3, torch.int16), (5, torch.int32),
                                                  (1, torch.int64), (77, torch.int16),
                                                  (2, torch.uint8), (9, torch.int32)])]
    named.append(("runs", torch.arange(40, dtype=torch.int16).view(4, 10)[:, :3]))  # strided
    copies = copied_in_groups(named, torch.device("cpu"))
    assert list(copies) == [name for name, _ in named]
    for name, tensor in named:
        assert copies[name].dtype == tensor.dtype and torch.equal(copies[name], tensor)
