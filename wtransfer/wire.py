"""The one codec for everything that crosses a process boundary: msgpack, strictly validated.

`encode` accepts plain data only (None, bool, int, float, str, bytes, lists, str-keyed dicts).
`decode` refuses anything malformed or hostile with `MetadataError`: oversized messages,
oversized strings/arrays/maps, extension types, non-string map keys, excessive nesting and
trailing bytes. `parse_record` turns a decoded mapping into a typed dataclass, checking every
field against its annotation so that backends never see an unchecked value. There is no pickle
anywhere in wtransfer; this module is why none is needed.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import types
import typing
from collections.abc import Callable, Hashable, Mapping
from typing import Any, TypeVar, Union, cast

import msgpack

from wtransfer.errors import ConfigError, MetadataError

MAX_MESSAGE_BYTES = 64 << 20
"""Default ceiling for one decoded message; control messages are small, so this is generous."""

MAX_DEPTH = 16
"""Deepest nesting of lists/maps any wtransfer message uses is 4; 16 leaves room, stops bombs."""


R = TypeVar("R")


def encode(obj: Any) -> bytes:
    """Encode plain data as msgpack bytes; anything else raises `MetadataError`."""
    try:
        return bytes(msgpack.packb(obj, use_bin_type=True))
    except (TypeError, ValueError, OverflowError) as exc:
        raise MetadataError(f"cannot encode message: {type(exc).__name__}: {exc}") from None


def digest(obj: Any) -> str:
    """A 128-bit digest (hex) of plain data, by its msgpack encoding: lets a peer name data the
    other side already holds instead of sending it again."""
    return hashlib.blake2b(encode(obj), digest_size=16).hexdigest()


def decode(data: bytes | bytearray | memoryview, *, max_bytes: int = MAX_MESSAGE_BYTES) -> Any:
    """Decode one msgpack message, refusing anything but plain, bounded data."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise MetadataError(f"expected bytes to decode, got {type(data).__name__}")
    size = len(data)
    if size > max_bytes:
        raise MetadataError(f"message of {size} bytes exceeds the {max_bytes}-byte limit")
    if size == 0:
        raise MetadataError("empty message")
    try:
        obj = msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            use_list=True,
            max_str_len=size,
            max_bin_len=size,
            max_array_len=size,
            max_map_len=size // 2 + 1,
            max_ext_len=0,
            ext_hook=_refuse_ext,
        )
    except msgpack.ExtraData:
        raise MetadataError("trailing bytes after the message") from None
    except MetadataError:
        raise
    except Exception as exc:  # msgpack raises many types (ValueError, FormatError, StackError…)
        raise MetadataError(f"malformed message: {type(exc).__name__}: {exc}") from None
    if type(obj) is list or type(obj) is dict:
        _check_plain(obj)
    return obj


def _refuse_ext(code: int, data: bytes) -> Any:
    raise MetadataError(f"msgpack extension type {code} is not allowed")


def _check_plain(obj: Any) -> None:
    """Refuse non-str keys and deep nesting (iteratively). What `msgpack.unpackb` returns
    with extensions refused holds only plain scalars in lists and dicts, and every msgpack
    integer fits in 64 bits, so only the containers are walked (an update's tensor list of
    hundreds of entries is checked on every update)."""
    stack: list[tuple[Any, int]] = [(obj, 0)]
    while stack:
        item, depth = stack.pop()
        if depth >= MAX_DEPTH:
            raise MetadataError(f"message nests deeper than {MAX_DEPTH} levels")
        if type(item) is dict:
            for key in item:
                if type(key) is not str:
                    raise MetadataError(f"map key {key!r:.40} is not a string")
            values = item.values()
        else:
            values = item
        for value in values:
            kind = type(value)
            if kind is list or kind is dict:
                stack.append((value, depth + 1))


# ---------------------------------------------------------------------------------------------
# Typed records: decoded mappings -> dataclasses, every field checked against its annotation.
# ---------------------------------------------------------------------------------------------


def parse_record(
    cls: type[R],
    data: R | Mapping[str, Any],
    *,
    where: str,
    error: type[Exception] = ConfigError,
) -> R:
    """Build dataclass `cls` from `data`, naming `where` and the bad field on any mismatch. An
    instance of `cls` passes through; unknown or missing required fields and values of the wrong
    type raise `error`, then the dataclass's `__post_init__` checks ranges."""
    if type(data) is not dict:  # (a decoded message is a plain dict: no instance checks)
        if isinstance(data, cls):
            return data
        if not isinstance(data, Mapping):
            raise error(f"{where}: expected a mapping or {cls.__name__}, "
                        f"got {type(data).__name__}")
    fields = _record_fields(cast(Hashable, cls))
    if not fields.checks.keys() >= data.keys():
        unknown = sorted(set(data) - set(fields.checks))
        raise error(f"{where}: unknown field(s) {unknown}; known fields are "
                    f"{sorted(fields.checks)}")
    checks = fields.checks  # the values given are checked first: their errors come first
    values = {name: checks[name](value, f"{where}: field '{name}'", error)
              for name, value in data.items()}
    if not data.keys() >= fields.required:
        missing = next(name for name in checks if name in fields.required and name not in data)
        raise error(f"{where}: missing required field '{missing}'")
    try:
        return cls(**values)
    except (ConfigError, MetadataError):
        raise
    except (TypeError, ValueError) as exc:
        raise error(f"{where}: {exc}") from None


Check = Callable[[Any, str, type[Exception]], Any]
"""A field's checker: ``check(value, where, error)`` returns the value (tuples for tuple
annotations) or raises `error` naming `where`."""


@dataclasses.dataclass(frozen=True)
class _Fields:
    """A record class's init fields: each one's checker, and the names without a default."""

    checks: dict[str, Check]
    required: frozenset[str]


@functools.cache
def _record_fields(cls: Hashable) -> _Fields:
    """A record class's fields, worked out once per class (resolving string annotations
    evaluates code, and a receiver parses a record every update)."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a dataclass")
    fields = [f for f in dataclasses.fields(cls) if f.init]
    hints = typing.get_type_hints(cls)
    return _Fields(
        checks={f.name: _checker(hints[f.name]) for f in fields},
        required=frozenset(f.name for f in fields if f.default is dataclasses.MISSING
                           and f.default_factory is dataclasses.MISSING))


def check_record_types(record: Any, error: type[Exception] = ConfigError) -> None:
    """Raise `error` naming the record class and field when a field of dataclass instance
    `record` does not match its annotation (a record built in Python, not parsed from the
    wire: ``bucket_bytes="64MB"`` is refused by name, not by a comparison deep inside)."""
    for name, check in _record_fields(cast(Hashable, type(record))).checks.items():
        check(getattr(record, name), f"{type(record).__name__}: field '{name}'", error)


def record_to_wire(record: Any) -> dict[str, Any]:
    """The plain-dict form of a dataclass record, ready for `encode`."""
    return {
        f.name: _to_plain(getattr(record, f.name)) for f in dataclasses.fields(record) if f.init
    }


def _to_plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return record_to_wire(value)
    if isinstance(value, tuple):
        return [_to_plain(v) for v in value]
    if isinstance(value, list):
        return [_to_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _to_plain(v) for k, v in value.items()}
    return value


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _scalar(kinds: tuple[type, ...], noun: str, convert: Callable[[Any], Any] | None) -> Check:
    """A checker for one scalar annotation: an instance of `kinds` (never a bool where a
    number is asked for), converted by `convert`."""
    strict_bool = bool not in kinds

    def check(value: Any, where: str, error: type[Exception]) -> Any:
        if isinstance(value, kinds) and not (strict_bool and isinstance(value, bool)):
            return value if convert is None else convert(value)
        raise error(f"{where} must be {noun}, got {type(value).__name__}")
    return check


_SCALARS: dict[Any, Check] = {
    bool: _scalar((bool,), "a bool", None),
    int: _scalar((int,), "an int", None),
    float: _scalar((int, float), "a number", float),
    str: _scalar((str,), "a string", None),
    bytes: _scalar((bytes, bytearray), "bytes", bytes),
}


def _anything(value: Any, where: str, error: type[Exception]) -> Any:
    return value  # the consumer of an Any field validates its content itself


def _nothing(value: Any, where: str, error: type[Exception]) -> Any:
    if value is None:
        return None
    raise error(f"{where} must be None, got {type(value).__name__}")


def _checker(tp: Any) -> Check:
    """The checker of annotation `tp`, built once per annotation (a receiver checks the same
    records every update). Cached by the annotation and the order of its arguments, at every
    depth: unions equal in any order (``int | float == float | int``) try their options in
    the order written, and the first that fits converts the value."""
    return _built_checker(tp, _argument_order(tp))


def _argument_order(tp: Any) -> tuple[Any, ...]:
    return tuple((arg, _argument_order(arg)) for arg in typing.get_args(tp))


@functools.cache
def _built_checker(tp: Any, order: tuple[Any, ...]) -> Check:
    if tp is Any:
        return _anything
    if tp is type(None):
        return _nothing
    if tp in _SCALARS:
        return _SCALARS[tp]
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        return _union(tp, args)
    if origin in (list, tuple):
        return _sequence(origin, args)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):  # a record inside a record
        return functools.partial(_nested, tp)
    if origin is dict:
        return _mapping(*(args or (str, Any)))

    def unsupported(value: Any, where: str, error: type[Exception]) -> Any:
        raise TypeError(f"{where}: unsupported annotation {tp!r}")
    return unsupported


def _nested(cls: type[Any], value: Any, where: str, error: type[Exception]) -> Any:
    return parse_record(cls, value, where=where, error=error)


def _union(tp: Any, args: tuple[Any, ...]) -> Check:
    options = [_checker(option) for option in args]
    optional = type(None) in args

    def check(value: Any, where: str, error: type[Exception]) -> Any:
        if value is None and optional:  # an optional field left empty
            return None
        for option in options:
            try:
                return option(value, where, error)
            except error:
                continue
        raise error(f"{where} must be {_type_name(tp)}, got {type(value).__name__}")
    return check


def _sequence(origin: Any, args: tuple[Any, ...]) -> Check:
    if origin is tuple and args and args[-1] is not Ellipsis:
        items = [_checker(a) for a in args]

        def fixed(value: Any, where: str, error: type[Exception]) -> Any:
            if not isinstance(value, (list, tuple)):
                raise error(f"{where} must be a list, got {type(value).__name__}")
            if len(value) != len(items):
                raise error(f"{where} must have {len(items)} items, got {len(value)}")
            return tuple(item(v, f"{where}[{i}]", error)
                         for i, (v, item) in enumerate(zip(value, items, strict=True)))
        return fixed
    item = _checker(args[0]) if args else _anything
    make: Callable[[Any], Any] = tuple if origin is tuple else list

    def each(value: Any, where: str, error: type[Exception]) -> Any:
        if not isinstance(value, (list, tuple)):
            raise error(f"{where} must be a list, got {type(value).__name__}")
        if item is _anything:
            return make(value)
        return make([item(v, f"{where}[{i}]", error) for i, v in enumerate(value)])
    return each


def _mapping(key_tp: Any, value_tp: Any) -> Check:
    key, item = _checker(key_tp), _checker(value_tp)

    def check(value: Any, where: str, error: type[Exception]) -> Any:
        if not isinstance(value, dict):
            raise error(f"{where} must be a mapping, got {type(value).__name__}")
        return {key(k, f"{where} key", error): item(v, f"{where}[{k!r}]", error)
                for k, v in value.items()}
    return check
