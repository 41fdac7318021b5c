"""Our init and update records inside vLLM's JSON routes: the record travels as msgpack
(`wtransfer.wire`, so bytes such as CUDA IPC handles survive) in one base64 string field.
In process (`AsyncLLM`), records pass as plain dicts and need no envelope."""

from __future__ import annotations

import base64
import binascii
from typing import Any

from wtransfer import wire
from wtransfer.errors import MetadataError

KEY = "wtransfer_msgpack"


def wrap(record: dict[str, Any]) -> dict[str, str]:
    """`record` as ``{"wtransfer_msgpack": <base64 of msgpack>}``."""
    return {KEY: base64.b64encode(wire.encode(record)).decode("ascii")}


def unwrap(data: Any) -> Any:
    """The record inside an envelope (decoded strictly), or `data` itself when it is none."""
    if not (isinstance(data, dict) and set(data) == {KEY}):
        return data
    try:
        raw = base64.b64decode(data[KEY], validate=True)
    except (binascii.Error, ValueError, TypeError) as exc:
        raise MetadataError(f"{KEY} is not valid base64: {exc}") from None
    return wire.decode(raw)
