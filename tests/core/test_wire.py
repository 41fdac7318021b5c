"""The wire codec: round trips plain data; refuses everything else with MetadataError."""

import contextlib
import math
from dataclasses import dataclass, field

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from wtransfer import wire
from wtransfer.errors import ConfigError, MetadataError
from wtransfer.packing import TensorMeta, metas_from_wire

plain = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.text(max_size=20)
    | st.binary(max_size=20) | st.floats(allow_nan=False),
    lambda kids: st.lists(kids, max_size=5) | st.dictionaries(st.text(max_size=8), kids,
                                                               max_size=5),
    max_leaves=30,
)


@given(plain)
def test_plain_data_round_trips(obj):
    assert wire.decode(wire.encode(obj)) == obj


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=200))
def test_arbitrary_bytes_decode_or_raise_metadata_error_only(data):
    with contextlib.suppress(MetadataError):
        wire.decode(data)


@settings(max_examples=300, deadline=None)
@given(plain, st.binary(min_size=1, max_size=8))
def test_trailing_bytes_are_refused(obj, extra):
    with pytest.raises(MetadataError):
        wire.decode(wire.encode(obj) + extra)


@settings(max_examples=300, deadline=None)
@given(plain)
def test_parsing_arbitrary_data_as_tensor_metadata_raises_only_metadata_error(obj):
    with contextlib.suppress(MetadataError):
        metas_from_wire(obj)


@pytest.mark.parametrize("payload, match", [
    (b"", "empty"),
    (msgpack.packb({1: 2}), "malformed"),
    (msgpack.packb(msgpack.ExtType(5, b"x")), "ext"),
    (b"\xdb\xff\xff\xff\xff", "malformed"),  # str32 claiming 4 GiB
    (b"\xdd\x7f\xff\xff\xff", "malformed"),  # array32 claiming 2^31 items
    (b"\x91" * 40 + b"\xc0", "deeper|malformed"),
])
def test_hostile_messages_are_refused(payload, match):
    with pytest.raises(MetadataError, match=match):
        wire.decode(payload)


def test_oversized_message_is_refused_before_decoding():
    with pytest.raises(MetadataError, match="limit"):
        wire.decode(b"\xc0" * 100, max_bytes=10)


def test_non_plain_objects_cannot_be_encoded():
    with pytest.raises(MetadataError, match="cannot encode"):
        wire.encode({"x": object()})
    with pytest.raises(MetadataError, match="cannot encode"):
        wire.encode(2**70)


@pytest.mark.parametrize("item, match", [
    (["w", "float33", [2]], "unknown dtype"),
    (["w", "float32", [-1]], "bad dim"),
    (["w", "float32", [2**40, 2**40]], "exceeds the limit"),
    (["", "float32", [1]], "non-empty"),
    (["w", "float32", [1] * 40], "at most"),
    (["w", "float32"], r"\[name, dtype, shape\]"),
    (["w", "float32", [True]], "bad dim"),
])
def test_bad_tensor_metadata_is_refused(item, match):
    with pytest.raises(MetadataError, match=match):
        TensorMeta.from_wire(item)


def test_duplicate_tensor_names_are_refused():
    with pytest.raises(MetadataError, match="twice"):
        metas_from_wire([["w", "float32", [1]], ["w", "float32", [1]]])


@dataclass(frozen=True, kw_only=True)
class Sample:
    count: int
    ratio: float = 1.0
    label: str | None = None
    items: list[list[int]] = field(default_factory=list)

    def __post_init__(self):
        if self.count < 0:
            raise ConfigError("count must be >= 0")


def test_parse_record_checks_every_field_and_names_it():
    got = wire.parse_record(Sample, {"count": 3, "ratio": 2, "items": [[1, 2]]}, where="demo")
    assert got == Sample(count=3, ratio=2.0, items=[[1, 2]])
    assert math.isclose(got.ratio, 2.0)
    for data, match in [
        ({"count": "3"}, "demo: field 'count' must be an int"),
        ({"count": True}, "field 'count' must be an int"),
        ({}, "missing required field 'count'"),
        ({"count": 1, "extra": 1}, r"unknown field\(s\) \['extra'\]"),
        ({"count": 1, "items": [["x"]]}, r"field 'items'\[0\]\[0\] must be an int"),
        ({"count": -1}, "count must be >= 0"),
        ([1, 2], "expected a mapping"),
    ]:
        with pytest.raises(ConfigError, match=match):
            wire.parse_record(Sample, data, where="demo")


@dataclass(frozen=True)
class NumberFirstFloat:
    value: float | int
    pairs: list[float | int]


@dataclass(frozen=True)
class NumberFirstInt:
    value: int | float
    pairs: list[int | float]


def test_a_union_tries_its_options_in_the_order_its_own_record_writes_them():
    """``float | int`` equals ``int | float``; each record still converts by its own order,
    whichever was parsed first (the checkers are built once and shared)."""
    data = {"value": 3, "pairs": [4]}
    first = wire.parse_record(NumberFirstFloat, data, where="demo")
    second = wire.parse_record(NumberFirstInt, data, where="demo")
    assert type(first.value) is float and type(first.pairs[0]) is float
    assert type(second.value) is int and type(second.pairs[0]) is int
