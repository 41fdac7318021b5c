"""Reading and checking HTTP request bodies for the server (JSON, or msgpack where a body
carries bytes), and the errors a bad body becomes. Nothing here trusts the client: sizes,
nesting, field names and types are checked before any value reaches the engine."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Collection
from typing import Any

from wtransfer import wire
from wtransfer.errors import (
    ConfigError,
    EngineDeadError,
    IntegrityError,
    LifecycleError,
    MetadataError,
    PeerError,
    TransferTimeout,
    WTransferError,
)

MSGPACK = "application/msgpack"


class Unauthorized(WTransferError):
    """A request without the right API key (answered with 401)."""


class BodyTooLarge(ConfigError):
    """A request body over the server's limit (answered with 413)."""


_STATUS: dict[type[WTransferError], int] = {
    BodyTooLarge: 413, Unauthorized: 401, ConfigError: 400,
    MetadataError: 400, IntegrityError: 422, LifecycleError: 409, EngineDeadError: 503,
    PeerError: 502, TransferTimeout: 504}
"""HTTP status of each error family, most specific first."""


def status_of(exc: WTransferError) -> int:
    """The HTTP status that answers `exc` (500 for a family without one)."""
    return next((code for kind, code in _STATUS.items() if isinstance(exc, kind)), 500)


def _depth(value: Any, limit: int) -> None:
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            if depth > limit:
                raise ConfigError(f"body nests deeper than {limit} levels")
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children)


async def read_body(chunks: AsyncIterator[bytes], content_type: str, limit: int) -> Any:
    """The decoded body (an empty body is ``{}``); `BodyTooLarge` past `limit` bytes (checked
    while streaming: chunked bodies carry no Content-Length), `ConfigError` when malformed or
    nested deeper than the wire codec allows."""
    parts, size = [], 0
    async for chunk in chunks:
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(f"body exceeds the {limit}-byte limit")
        parts.append(chunk)
    raw = b"".join(parts)
    if not raw:
        return {}
    if content_type.startswith(MSGPACK):
        return wire.decode(raw, max_bytes=limit)
    try:
        body = json.loads(raw)
    except RecursionError:
        raise ConfigError(f"body nests deeper than {wire.MAX_DEPTH} levels") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise ConfigError(f"body is not valid JSON: {exc}") from None
    _depth(body, wire.MAX_DEPTH)
    return body


def check_fields(body: Any, allowed: Collection[str]) -> dict[str, Any]:
    """`body` as a dict with no field outside `allowed` (an unknown field is a 400 that lists
    the known ones, so a typo never passes silently)."""
    if not isinstance(body, dict):
        raise ConfigError("body must be a JSON object")
    unknown = sorted(set(body) - set(allowed))
    if unknown:
        raise ConfigError(f"unknown field(s) {unknown}; known fields are {sorted(allowed)}")
    return body


def field(body: dict[str, Any], name: str, kind: type | tuple[type, ...],
          default: Any = ...) -> Any:
    """`body[name]` checked against `kind`; missing or null gives `default` (required when
    there is none)."""
    if name not in body or body[name] is None:
        if default is ...:
            raise ConfigError(f"missing field {name!r}")
        return default
    value = body[name]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ConfigError(f"field {name!r} must be {getattr(kind, '__name__', kind)}")
    return value
