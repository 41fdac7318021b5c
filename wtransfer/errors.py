"""The exception hierarchy of wtransfer.

Every error the library raises on purpose derives from `WTransferError`, so a caller can catch
the whole family; each subclass names one kind of failure and its message says what to fix.
"""

from __future__ import annotations

import re
from typing import Any


class WTransferError(Exception):
    """Base class of every error wtransfer raises on purpose."""


class ConfigError(WTransferError, ValueError):
    """A configuration value or init/update field is invalid (also a `ValueError`)."""


class LifecycleError(WTransferError):
    """A call arrived in a state where it is not allowed (e.g. update before start)."""


class NotInitializedError(LifecycleError):
    """A receiver holds no sender's init: it is new, or its engine restarted since the sender's
    `trainer_init` (a lone sender then initializes it again by itself and sends in full)."""


class SenderReplacedError(LifecycleError):
    """A receiver refused a sender because a newer `trainer_init` replaced it on the same
    receivers (a re-run notebook cell, a restarted trainer): create a new sender."""


class MetadataError(WTransferError):
    """Metadata is malformed, hostile, or does not match what the receiver holds."""


class IntegrityError(WTransferError):
    """Received bytes failed verification (checksum mismatch or incomplete update)."""


class NonFiniteError(IntegrityError):
    """A receiver refused an update holding NaN or infinite values before it went live (the
    error names the first such tensor); a sender that means to send them opts out with
    ``allow_non_finite=True``."""


class DeltaBaseError(IntegrityError):
    """A receiver refused a delta update before writing anything: it does not hold the base
    the delta applies onto (it restarted, rolled back, failed an update, or another sender
    wrote it). A delta-enabled sender then sends the update in full by itself."""


class SparseDeltaError(DeltaBaseError):
    """A receiver whose target cannot apply sparse deltas (it offers no view of its weights)
    refused one: the sender sends changed tensors whole from then on."""


class DeltaUnsupportedError(DeltaBaseError):
    """A receiver whose target takes full updates only refused a delta: the sender stops
    diffing and sends every later update in full."""


class TransferTimeout(WTransferError, TimeoutError):
    """A blocking wait ran past its deadline (the peer is gone, slow, or never showed up)."""


class EngineDeadError(WTransferError):
    """The inference engine hit a failure it cannot continue after; every call fails with this
    until it is restarted (its message says what failed)."""


class PeerError(WTransferError):
    """The other side of a transfer failed; carries its error type and message."""

    def __init__(self, message: str, *, remote_type: str | None = None) -> None:
        super().__init__(message)
        self.remote_type = remote_type
        """Name of the exception class raised on the remote side, when known."""


class RemoteConfigError(PeerError, ConfigError):
    """The peer refused a configuration value (a `PeerError` and a `ConfigError`)."""


class RemoteLifecycleError(PeerError, LifecycleError):
    """The peer refused a call in its current state (a `PeerError` and a `LifecycleError`)."""


class RemoteNotInitializedError(PeerError, NotInitializedError):
    """The peer holds no sender's init (a `PeerError` and a `NotInitializedError`)."""


class RemoteSenderReplacedError(PeerError, SenderReplacedError):
    """The peer refused this sender: a newer one replaced it (a `PeerError` and a
    `SenderReplacedError`)."""


class RemoteMetadataError(PeerError, MetadataError):
    """The peer refused metadata (a `PeerError` and a `MetadataError`)."""


class RemoteIntegrityError(PeerError, IntegrityError):
    """The peer found corrupt or missing bytes (a `PeerError` and an `IntegrityError`)."""


class RemoteNonFiniteError(PeerError, NonFiniteError):
    """The peer refused values that are NaN or infinite (a `PeerError` and a
    `NonFiniteError`)."""


class RemoteDeltaBaseError(PeerError, DeltaBaseError):
    """The peer refused a delta for want of its base (a `PeerError` and a `DeltaBaseError`)."""


class RemoteSparseDeltaError(PeerError, SparseDeltaError):
    """The peer cannot apply sparse deltas (a `PeerError` and a `SparseDeltaError`)."""


class RemoteDeltaUnsupportedError(PeerError, DeltaUnsupportedError):
    """The peer takes full updates only (a `PeerError` and a `DeltaUnsupportedError`)."""


class RemoteTransferTimeout(PeerError, TransferTimeout):
    """A wait on the peer's side ran past its deadline (a `PeerError` and a
    `TransferTimeout`)."""


class RemoteEngineDeadError(PeerError, EngineDeadError):
    """The peer's engine cannot continue (a `PeerError` and an `EngineDeadError`)."""


_REMOTE: dict[str, type[PeerError]] = {
    "ConfigError": RemoteConfigError,
    "LifecycleError": RemoteLifecycleError, "MetadataError": RemoteMetadataError,
    "SenderReplacedError": RemoteSenderReplacedError,
    "NotInitializedError": RemoteNotInitializedError,
    "IntegrityError": RemoteIntegrityError, "TransferTimeout": RemoteTransferTimeout,
    "NonFiniteError": RemoteNonFiniteError,
    "DeltaBaseError": RemoteDeltaBaseError, "SparseDeltaError": RemoteSparseDeltaError,
    "DeltaUnsupportedError": RemoteDeltaUnsupportedError,
    "EngineDeadError": RemoteEngineDeadError,
}


def ok_reply(result: object) -> dict[str, object]:
    """A successful call's reply: ``{"ok": true, "result": ...}`` (every control plane)."""
    return {"ok": True, "result": result}


def reply_result(reply: object, where: str) -> Any:
    """The result a reply carries, or the failure it carries raised (`from_reply`, its
    message led by `where`); `MetadataError` for anything that is not a reply."""
    if not isinstance(reply, dict) or not isinstance(reply.get("ok"), bool):
        raise MetadataError(f"{where}: malformed reply {reply!r:.200}")
    if not reply["ok"]:
        raise from_reply(reply, where)
    return reply.get("result")


def error_reply(exc: BaseException) -> dict[str, object]:
    """A failed call's reply, as plain data: ``{"ok": false, "type": <class>, "message"}``.

    Every control plane answers failures this way; `from_reply` turns one back into an exception."""
    return {"ok": False, "type": error_kind(exc), "message": str(exc)}


def error_kind(exc: BaseException) -> str:
    """The type name a reply gives `exc`: a relayed peer failure keeps the type its origin
    raised (a `RemoteLifecycleError` from a data-parallel rank travels on as
    "LifecycleError"), so every hop rebuilds the same kind."""
    if isinstance(exc, PeerError) and exc.remote_type:
        return exc.remote_type
    return type(exc).__name__


def from_reply(reply: object, where: str) -> PeerError:
    """The exception for a failed reply from `where`: always a `PeerError` (the peer failed),
    and also the matching wtransfer type when the peer raised one (`RemoteMetadataError` is a
    `MetadataError` too), so callers and HTTP status codes can react to the kind of failure."""
    fields = reply if isinstance(reply, dict) else {}
    kind = str(fields.get("type", "Exception"))
    message = str(fields.get("message", reply if not fields else ""))
    return remote_error(f"{where}: {kind}: {message}", kind)


_RELAYED = re.compile(r"\b(" + "|".join(sorted(_REMOTE, key=len, reverse=True)) + r"): ")


def relayed_kind(message: str) -> str | None:
    """The wtransfer error type a foreign peer relayed only as text (vLLM passes a worker's
    failure on as ``"... '<Kind>: <message>'"``): the first ``<Kind>: `` in `message` that
    names one, else None."""
    found = _RELAYED.search(message)
    return found.group(1) if found else None


def remote_error(message: str, kind: str) -> PeerError:
    """A `PeerError` for a failure of type name `kind` on a peer, also of the matching
    wtransfer type when there is one (kind "LifecycleError": a `RemoteLifecycleError`)."""
    return _REMOTE.get(kind, PeerError)(message, remote_type=kind)


__all__ = [
    "ConfigError",
    "DeltaBaseError",
    "DeltaUnsupportedError",
    "EngineDeadError",
    "IntegrityError",
    "LifecycleError",
    "MetadataError",
    "NonFiniteError",
    "NotInitializedError",
    "PeerError",
    "RemoteConfigError",
    "RemoteDeltaBaseError",
    "RemoteDeltaUnsupportedError",
    "RemoteEngineDeadError",
    "RemoteIntegrityError",
    "RemoteLifecycleError",
    "RemoteMetadataError",
    "RemoteNonFiniteError",
    "RemoteNotInitializedError",
    "RemoteSenderReplacedError",
    "RemoteSparseDeltaError",
    "RemoteTransferTimeout",
    "SenderReplacedError",
    "SparseDeltaError",
    "TransferTimeout",
    "WTransferError",
    "error_kind",
    "error_reply",
    "from_reply",
    "ok_reply",
    "relayed_kind",
    "remote_error",
    "reply_result",
]
