"""The one module that speaks ZeroMQ: the sockets of every control channel in wtransfer.

A receiver's control plane (`wtransfer.rpc`), an engine's tensor-parallel workers
(`wtransfer.inference.tp`) and its data-parallel ranks (`wtransfer.inference.dp`) talk over
`Channel`s: a bound one (`Channel.serve`, many peers, each message prefixed by its peer's
identity frame) or a connected one (`Channel.connect`, one peer). Messages are lists of byte
frames; what the frames hold is msgpack through `wtransfer.wire` (`send_record`,
`receive_record`), never pickle. A call that would block with `block=False` returns at once
(`send` False, `receive` None).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import zmq

from wtransfer import wire
from wtransfer.errors import ConfigError


class ChannelClosedError(ConnectionError):
    """The channel (or a peer a bound channel must reach) is gone."""


class Channel:
    """One ZeroMQ socket (see the module docstring); not thread-safe: guard it with a lock."""

    def __init__(self, socket: zmq.Socket[bytes], address: str) -> None:
        self._socket = socket
        self.address = address
        """Where peers connect (a bound channel: its real port), or where this one connected."""

    @classmethod
    def serve(cls, address: str = "tcp://127.0.0.1:*", *, max_message_bytes: int | None = None,
              peers_must_exist: bool = False) -> Channel:
        """A channel bound at `address` (port 0 or * picks a free one) for many peers; with
        `peers_must_exist` a message to a peer that is not connected raises
        `ChannelClosedError` instead of being dropped. `ConfigError` if it cannot bind."""
        socket: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.ROUTER)
        socket.setsockopt(zmq.LINGER, 0)
        if max_message_bytes is not None:
            socket.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        if peers_must_exist:
            socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        bind = address[:-2] + ":*" if address.startswith("tcp://") and address.endswith(":0") \
            else address
        try:
            socket.bind(bind)
        except zmq.ZMQError as exc:
            socket.close()
            raise ConfigError(f"cannot bind a channel to {address!r}: {exc}") from None
        return cls(socket, socket.getsockopt_string(zmq.LAST_ENDPOINT))

    @classmethod
    def connect(cls, address: str, *, identity: str | None = None,
                linger_ms: int = 0) -> Channel:
        """A channel to the bound channel at `address`, named `identity` there (else a name
        ZeroMQ picks); what is unsent at close is kept `linger_ms`. `ConfigError` on a
        malformed address."""
        socket: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, linger_ms)
        if identity is not None:
            socket.setsockopt(zmq.IDENTITY, identity.encode())
        try:
            socket.connect(address)
        except zmq.ZMQError as exc:
            socket.close()
            raise ConfigError(f"bad channel address {address!r}: {exc}") from None
        return cls(socket, address)

    @classmethod
    def wakeup_pair(cls, name: str) -> tuple[Channel, Channel]:
        """A (sender, receiver) pair inside this process, for waking a loop that waits on
        other channels too (`wait_any`)."""
        context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        receiver = context.socket(zmq.PULL)
        receiver.bind(f"inproc://{name}")
        sender = context.socket(zmq.PUSH)
        sender.connect(f"inproc://{name}")
        address = f"inproc://{name}"
        return cls(sender, address), cls(receiver, address)

    @property
    def closed(self) -> bool:
        """Whether `close` was called."""
        return bool(self._socket.closed)

    @property
    def fd(self) -> int:
        """A descriptor that turns readable when the channel's state may have changed (then
        `readable` says whether a message waits)."""
        return int(self._socket.getsockopt(zmq.FD))

    def readable(self) -> bool:
        """Whether a message waits now (never blocks)."""
        return bool(int(self._socket.getsockopt(zmq.EVENTS)) & zmq.POLLIN)

    def wait(self, timeout_ms: int, *, writable: bool = False) -> bool:
        """Wait up to `timeout_ms` until a message waits (or, `writable`, one can be sent)."""
        return bool(self._socket.poll(timeout_ms, zmq.POLLOUT if writable else zmq.POLLIN))

    def send(self, frames: Sequence[bytes], *, block: bool = True) -> bool:
        """Send one message; False when `block` is off and it cannot leave now.
        `ChannelClosedError` when a bound channel's peer is not there (`peers_must_exist`)."""
        try:
            self._socket.send_multipart(list(frames), 0 if block else zmq.NOBLOCK)
        except zmq.Again:
            return False
        except zmq.ZMQError as exc:
            raise ChannelClosedError(f"channel {self.address}: {exc}") from None
        return True

    def receive(self, *, block: bool = True) -> list[bytes] | None:
        """The next message's frames; None when `block` is off and none waits."""
        try:
            return list(self._socket.recv_multipart(0 if block else zmq.NOBLOCK))
        except zmq.Again:
            return None

    def waiting(self) -> Iterator[list[bytes]]:
        """Every message waiting now, without blocking."""
        while (frames := self.receive(block=False)) is not None:
            yield frames

    def close(self, linger_ms: int | None = None) -> None:
        """Close the channel (what is unsent is kept `linger_ms`, else the channel's own)."""
        self._socket.close(linger=linger_ms)


def send_record(channel: Channel, record: dict[str, Any], *, to: bytes | None = None) -> None:
    """Send one msgpack record (to peer `to`, on a bound channel)."""
    payload = wire.encode(record)
    channel.send([to, payload] if to is not None else [payload])


def receive_record(channel: Channel, *, block: bool = True
                   ) -> tuple[bytes | None, dict[str, Any]] | None:
    """The next record and, on a bound channel, the peer it came from; None when `block` is
    off and none waits."""
    frames = channel.receive(block=block)
    if frames is None:
        return None
    peer, payload = (frames[0], frames[-1]) if len(frames) > 1 else (None, frames[0])
    return peer, wire.decode(payload)


def wait_any(channels: Sequence[Channel], timeout_ms: int) -> list[Channel]:
    """The channels of `channels` where a message waits, waiting up to `timeout_ms`."""
    poller = zmq.Poller()
    for channel in channels:
        poller.register(channel._socket, zmq.POLLIN)
    ready = {socket for socket, _ in poller.poll(timeout_ms)}
    return [c for c in channels if c._socket in ready]
