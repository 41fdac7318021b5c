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
from collections.abc import Hashable, Mapping
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
    """Build dataclass `cls` from `data`, naming `where` and the bad field on any mismatch.

    An instance of `cls` passes through unchanged. Unknown fields, missing required fields and
    values of the wrong type raise `error`; the dataclass's own `__post_init__` then checks ranges.
    """
    if isinstance(data, cls):
        return data
    if not isinstance(data, Mapping):
        raise error(f"{where}: expected a mapping or {cls.__name__}, got {type(data).__name__}")
    fields, hints = _record_fields(cast(Hashable, cls))
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise error(f"{where}: unknown field(s) {unknown}; known fields are {sorted(fields)}")
    values: dict[str, Any] = {}
    for name, field in fields.items():
        if name not in data:
            has_default = (
                field.default is not dataclasses.MISSING
                or field.default_factory is not dataclasses.MISSING
            )
            if not has_default:
                raise error(f"{where}: missing required field '{name}'")
            continue
        values[name] = _coerce(data[name], hints[name], f"{where}: field '{name}'", error)
    try:
        return cls(**values)
    except (ConfigError, MetadataError):
        raise
    except (TypeError, ValueError) as exc:
        raise error(f"{where}: {exc}") from None


@functools.cache
def _record_fields(cls: Hashable) -> tuple[dict[str, dataclasses.Field[Any]], dict[str, Any]]:
    """A record class's init fields and resolved annotations, worked out once per class
    (resolving string annotations evaluates code; a receiver parses a record every update)."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a dataclass")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    return fields, typing.get_type_hints(cls)


def check_record_types(record: Any, error: type[Exception] = ConfigError) -> None:
    """Raise `error` naming the record class and field when a field of dataclass instance
    `record` does not match its annotation (a record built in Python, not parsed from the
    wire: ``bucket_bytes="64MB"`` is refused by name, not by a comparison deep inside)."""
    fields, hints = _record_fields(cast(Hashable, type(record)))
    for name in fields:
        _coerce(getattr(record, name), hints[name],
                f"{type(record).__name__}: field '{name}'", error)


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


def _coerce(value: Any, tp: Any, where: str, error: type[Exception]) -> Any:
    """Check `value` against annotation `tp`; return it (tuples for tuple annotations)."""
    if tp is Any:  # the consumer of an Any field validates its content itself
        return value
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        for option in typing.get_args(tp):
            try:
                return _coerce(value, option, where, error)
            except error:
                continue
        raise error(f"{where} must be {_type_name(tp)}, got {type(value).__name__}")
    if tp is type(None):
        if value is None:
            return None
        raise error(f"{where} must be None, got {type(value).__name__}")
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise error(f"{where} must be a bool, got {type(value).__name__}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise error(f"{where} must be an int, got {type(value).__name__}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise error(f"{where} must be a number, got {type(value).__name__}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise error(f"{where} must be a string, got {type(value).__name__}")
    if tp is bytes:
        if isinstance(value, (bytes, bytearray)):
            return bytes(value)
        raise error(f"{where} must be bytes, got {type(value).__name__}")
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise error(f"{where} must be a list, got {type(value).__name__}")
        args = typing.get_args(tp)
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                raise error(f"{where} must have {len(args)} items, got {len(value)}")
            return tuple(
                _coerce(v, a, f"{where}[{i}]", error)
                for i, (v, a) in enumerate(zip(value, args, strict=True))
            )
        item_tp = args[0] if args else Any
        items = [_coerce(v, item_tp, f"{where}[{i}]", error) for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):  # a record inside a record
        return parse_record(tp, value, where=where, error=error)
    if origin is dict:
        if not isinstance(value, dict):
            raise error(f"{where} must be a mapping, got {type(value).__name__}")
        key_tp, val_tp = typing.get_args(tp) or (str, Any)
        return {
            _coerce(k, key_tp, f"{where} key", error): _coerce(v, val_tp, f"{where}[{k!r}]", error)
            for k, v in value.items()
        }
    raise TypeError(f"{where}: unsupported annotation {tp!r}")
