"""The delta codec on real tensors: which elements changed (every dtype, word path and
element path), payloads that round-trip, and malformed payloads or headers refused."""

import pytest
import torch

from wtransfer.delta.codec import (
    DeltaEntry,
    bits,
    changed,
    decode_sparse,
    encode_sparse,
    index_dtype_for,
    parsed_entries,
    sparse_limit,
)
from wtransfer.errors import MetadataError
from wtransfer.packing import TensorMeta, dtype_name
from wtransfer.records import DeltaHeader

DTYPES = [torch.bfloat16, torch.float32, torch.float16, torch.float64, torch.int8,
          torch.int32, torch.int64, torch.bool, torch.float8_e4m3fn]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("numel", [1, 1000, 70_001 * 8])
def test_changed_finds_exactly_the_elements_whose_bits_differ(dtype, numel):
    gen = torch.Generator().manual_seed(numel)
    old = torch.randint(0, 255, (numel * torch.empty((), dtype=dtype).element_size(),),
                        generator=gen, dtype=torch.uint8)
    if dtype == torch.bool:
        old = old % 2
    old = old.view(dtype)
    new = old.clone()
    flip = torch.randperm(numel, generator=gen)[:max(1, numel // 97)]
    bits(new)[flip] ^= 1
    last = bits(old).clone()
    want = torch.sort(flip).values
    index, count = changed(new, last, numel)
    assert torch.equal(index, want) and count == want.numel()
    assert changed(new, last, 0) == (None, want.numel())  # more than the limit changed
    assert changed(new, last, want.numel() - 1) == (None, want.numel())
    none, zero = changed(old, last, 0)
    assert none.numel() == 0 and zero == 0

    meta = TensorMeta("t", dtype_name(dtype), (numel,))
    index_dtype = index_dtype_for(numel)
    values = bits(new)[want]
    payload = encode_sparse(values, want, index_dtype)
    entry = DeltaEntry("t", want.numel(), index_dtype, dtype_name(dtype))
    assert entry.wire_meta(meta).nbytes == payload.numel()
    index, got = decode_sparse(payload, entry, meta)
    assert torch.equal(index, want) and torch.equal(got, values)


def test_a_payload_at_an_odd_byte_of_a_bucket_decodes():
    meta = TensorMeta("t", "float32", (100_000,))
    index = torch.tensor([3, 70_000, 99_999])
    values = torch.tensor([1.5, -2.0, 7.0]).view(torch.int32)
    payload = encode_sparse(values, index, "int32")
    bucket = torch.zeros(payload.numel() + 1, dtype=torch.uint8)
    bucket[1:] = payload
    got_index, got = decode_sparse(bucket[1:], DeltaEntry("t", 3, "int32", "float32"), meta)
    assert torch.equal(got_index, index) and torch.equal(got, values)


def test_malformed_payloads_are_refused():
    meta = TensorMeta("t", "bfloat16", (10,))
    good = encode_sparse(torch.tensor([1, 2], dtype=torch.int16), torch.tensor([2, 5]),
                         "uint16")
    entry = DeltaEntry("t", 2, "uint16", "bfloat16")
    with pytest.raises(MetadataError, match="payload of 7 bytes, expected 8"):
        decode_sparse(good[:7], entry, meta)
    outside = encode_sparse(torch.tensor([1, 2], dtype=torch.int16), torch.tensor([2, 10]),
                            "uint16")
    with pytest.raises(MetadataError, match="indices must ascend within"):
        decode_sparse(outside, entry, meta)
    twice = encode_sparse(torch.tensor([1, 2], dtype=torch.int16), torch.tensor([5, 5]),
                          "uint16")
    with pytest.raises(MetadataError, match="indices must ascend within"):
        decode_sparse(twice, entry, meta)
    with pytest.raises(MetadataError, match="11 changed elements of a tensor of 10"):
        DeltaEntry("t", 11, "uint16", "bfloat16").wire_meta(meta)
    with pytest.raises(MetadataError, match="unknown index dtype"):
        DeltaEntry("t", 1, "int8", "bfloat16")
    with pytest.raises(MetadataError, match="malformed delta entry"):
        DeltaEntry.from_wire(["t", "1", "int32", "bfloat16"])


def test_headers_are_checked():
    with pytest.raises(MetadataError, match="32 lowercase hex digits"):
        DeltaHeader(token="nothex")
    with pytest.raises(MetadataError, match="carries no delta entries"):
        DeltaHeader(token="a" * 32, entries=[["t", 1, "int32", "bfloat16"]])
    with pytest.raises(MetadataError, match="names a tensor twice"):
        parsed_entries(DeltaHeader(token="a" * 32, base="b" * 32, entries=[
            ["t", 1, "int32", "bfloat16"], ["t", 2, "int32", "bfloat16"]]))


def test_sparse_goes_while_the_payload_is_at_most_half_the_tensor():
    assert sparse_limit(1000, "uint16", 2) == 1000 * 2 // 8
    assert index_dtype_for(1 << 16) == "uint16" and index_dtype_for((1 << 16) + 1) == "int32"
