"""A TCP connection from each engine worker to its trainer that carries nothing and tells the
engine, within moments, that the trainer process is gone.

The trainer listens on a port of its own and never accepts: each engine's connection completes
in the trainer's kernel and waits in the accept queue. When the trainer process exits or is
killed, its kernel closes the listening socket and resets every queued connection, so the
engine's next look at its end (a non-blocking read) sees the reset. A trainer host that
vanishes without a word sends no reset; then the transfer's deadline still applies.

For backends whose data plane cannot tell a dead peer from a slow one (an NCCL broadcast waits
forever for a rank that died).
"""

from __future__ import annotations

import contextlib
import select
import socket
import time

_BACKLOG = 1024
"""Connections the trainer's kernel holds for it; the system's ``somaxconn`` caps it."""


class LifelineListener:
    """Trainer side: the port engines connect their lifelines to (see the module docstring),
    on `address` (the trainer's address the engines reach it at) when this host has it, else
    on every interface (an address behind a NAT or a name this host does not hold)."""

    def __init__(self, address: str = "") -> None:
        listening = _listen_on(address) if address else None
        if listening is None:
            family = socket.AF_INET6 if socket.has_dualstack_ipv6() else socket.AF_INET
            listening = socket.create_server(("", 0), family=family, backlog=_BACKLOG,
                                             dualstack_ipv6=family == socket.AF_INET6)
        self._socket = listening
        self.port: int = self._socket.getsockname()[1]
        """The port to send the engines."""

    def close(self) -> None:
        """Stop listening: every engine's lifeline to it sees a reset."""
        self._socket.close()


def _listen_on(address: str) -> socket.socket | None:
    """A listening socket on `address` (any free port), or None when this host cannot."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    try:
        return socket.create_server((address, 0), family=family, backlog=_BACKLOG)
    except OSError:
        return None


class Lifeline:
    """Engine side: one connection to a trainer's `LifelineListener`; `gone` never blocks.

    A lifeline that could not connect (a firewall, an address this host cannot reach) is
    inert: it never reports the trainer gone, and the transfer's deadline alone applies."""

    def __init__(self, address: str, port: int, timeout_s: float) -> None:
        self._socket: socket.socket | None = None
        self.error: str | None = None
        """Why the lifeline is inert (None: connected)."""
        try:
            sock = socket.create_connection((address, port), timeout=timeout_s)
        except OSError as exc:
            self.error = f"could not connect to {address}:{port}: {exc}"
            return
        sock.setblocking(False)
        self._socket = sock

    @property
    def active(self) -> bool:
        """Whether this lifeline can tell (it connected)."""
        return self._socket is not None

    def gone(self) -> bool:
        """True once the trainer's end was reset or closed (never for an inert lifeline)."""
        sock = self._socket
        if sock is None:
            return False
        try:
            return sock.recv(1) == b""  # the trainer never writes: bytes are not expected
        except BlockingIOError:
            return False
        except OSError:  # reset: the trainer's kernel closed its listening socket
            return True

    def wait(self, timeout_s: float) -> bool:
        """Block up to `timeout_s` for the trainer's end to reset or close; whether it did
        (False at once for an inert lifeline)."""
        sock = self._socket
        if sock is None:
            return False
        deadline = time.monotonic() + timeout_s
        while not self.gone():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            select.select([sock], [], [], left)  # readable: a reset, a close or a byte
        return True

    def close(self) -> None:
        """Drop the connection."""
        sock, self._socket = self._socket, None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.close()
