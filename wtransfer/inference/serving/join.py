"""A new instance joins a fleet from a running peer: it starts with the peer's current weights
and weight version, pulled engine to engine, without waiting for the trainer's next step.

The joiner serves a receiver for a moment (`AsyncEngine.serve_rpc`) and asks the peer, over
its authenticated HTTP API (``POST /push_weights``, dev mode), to send its live weights there
as a trainer would (`Replica.push_weights`: through the joiner's backend, labelled with the
peer's version). The joiner then checks that what it holds digests exactly as the peer's
weights do; anything else (the peer unreachable, dead mid-copy, refusing, or a mismatch) is an
error before the joiner serves a single request.
"""

from __future__ import annotations

import socket
from typing import Any
from urllib.parse import urlparse

from wtransfer.control.clients import HTTPClient
from wtransfer.errors import IntegrityError
from wtransfer.inference.async_engine import AsyncEngine

JOIN_TIMEOUT_S = 600.0
"""Deadline of the whole copy from the peer."""


def reachable_host(host: str) -> str:
    """The address a peer reaches this host at: `host`, or this host's own address where
    `host` is a wildcard (0.0.0.0, ::)."""
    if host in ("0.0.0.0", "::", ""):
        return socket.gethostbyname(socket.gethostname())
    return host


def join_from_peer(engine: AsyncEngine, peer_url: str, *, api_key: str | None = None,
                   host: str = "127.0.0.1", timeout_s: float = JOIN_TIMEOUT_S) -> str:
    """Pull the live weights and weight version of the instance at `peer_url` into `engine`
    (see the module docstring); returns the version. Raises (`PeerError`,
    `TransferTimeout`, `IntegrityError`) when the copy did not land whole."""
    backend = engine.config.weight_transfer_backend
    fields: dict[str, Any] = {"timeout_s": timeout_s}
    if backend == "nccl":  # the peer hosts the rendezvous: where this host reaches it
        fields["master_address"] = urlparse(peer_url).hostname or "127.0.0.1"
    address = engine.serve_rpc(f"tcp://{reachable_host(host)}:0")
    peer = HTTPClient(peer_url, api_key=api_key, timeout_s=timeout_s)
    try:
        sent = peer.push_weights(address, backend, fields)
    finally:
        engine.stop_rpc(address)
        peer.close()
    held = engine.call("fingerprint")
    if held != sent["fingerprint"]:
        differ = sorted(n for n in set(held) | set(sent["fingerprint"])
                        if held.get(n) != sent["fingerprint"].get(n))
        raise IntegrityError(f"the weights copied from {peer_url} differ from the peer's: "
                             f"{differ[:3]} (and {max(0, len(differ) - 3)} more)")
    version = str(sent["weight_version"])
    engine.call("update_weight_version", version)
    return version
