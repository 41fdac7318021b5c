"""The exception hierarchy of wtransfer.

Every error the library raises on purpose derives from `WTransferError`, so a caller can catch
the whole family; each subclass names one kind of failure and its message says what to fix.
"""

from __future__ import annotations


class WTransferError(Exception):
    """Base class of every error wtransfer raises on purpose."""


class ConfigError(WTransferError, ValueError):
    """A configuration value or init/update field is invalid (also a `ValueError`)."""


class LifecycleError(WTransferError):
    """A call arrived in a state where it is not allowed (e.g. update before start)."""


class MetadataError(WTransferError):
    """Metadata is malformed, hostile, or does not match what the receiver holds."""


class IntegrityError(WTransferError):
    """Received bytes failed verification (checksum mismatch or incomplete update)."""


class TransferTimeout(WTransferError, TimeoutError):
    """A blocking wait ran past its deadline (the peer is gone, slow, or never showed up)."""


class PeerError(WTransferError):
    """The other side of a transfer failed; carries its error type and message."""

    def __init__(self, message: str, *, remote_type: str | None = None) -> None:
        super().__init__(message)
        self.remote_type = remote_type
        """Name of the exception class raised on the remote side, when known."""


__all__ = [
    "ConfigError",
    "IntegrityError",
    "LifecycleError",
    "MetadataError",
    "PeerError",
    "TransferTimeout",
    "WTransferError",
]
