"""The trainer side of the lifecycle: the `WeightSyncClient` protocol and the sender ABC.

A sender is built in two steps: a plain constructor that declares every field (so teardown
works from any point), then `connect()`, the one step that does I/O: allocate staging, form
groups, and send each receiver its init info through the client. `TrainerTransferEngine.
trainer_init` (and `wtransfer.trainer_init`) does both and cleans up if `connect` fails.
"""

from __future__ import annotations

import contextlib
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar, Generic, Protocol, TypeVar, runtime_checkable

import torch

from wtransfer.errors import LifecycleError, TransferTimeout
from wtransfer.infos import TrainerInitInfo, TransferStats
from wtransfer.packing import BucketPlan
from wtransfer.source import WeightSource
from wtransfer.wire import parse_record

TInitT = TypeVar("TInitT", bound=TrainerInitInfo)
S = TypeVar("S", bound="TrainerTransferEngine[Any]")

InitFor = Callable[[int, int], dict[str, Any]]
"""``info_for(first_worker, num_workers)``: the init info of one engine instance, given the
index of its first receiving worker among all workers and how many it has."""


@runtime_checkable
class WeightSyncClient(Protocol):
    """What a sender calls on whatever holds the receiving engine(s).

    One client reaches one engine instance (`LocalClient`, `rpc.RPCClient`, `HTTPClient`) or
    several (`FanoutClient`); an engine instance has one or more receiving workers (its
    data-parallel ranks).
    """

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """Initialize every receiver behind this client with the same init info."""

    def init_each_engine(self, info_for: InitFor) -> None:
        """Initialize each engine instance with its own init info, ``info_for(first_worker,
        num_workers)`` (collective backends give each engine its ranks this way)."""

    def start_weight_update(self) -> None:
        """Open an update."""

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Deliver one part of the update; returns once the receiver consumed it."""

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """Close the update and label the weights with `weight_version`."""

    def fingerprint(self) -> dict[str, str]:
        """Per-tensor digest of what the engine holds now."""

    def num_workers(self) -> int:
        """How many receiving workers this client drives in all (senders size NCCL groups and
        UCX endpoint counts by it)."""


class TrainerTransferEngine(ABC, Generic[TInitT]):
    """Sender ABC: construct, `connect()`, then `send_weights` any number of times.

    Subclasses declare their fields in `__init__` (calling this one first) and implement
    `_connect` (allocate, return the receiver init info), `_send` and `_close`.
    """

    backend_name: ClassVar[str]
    init_info_cls: ClassVar[type]

    def __init__(self, init_info: TInitT, *, client: WeightSyncClient,
                 source: WeightSource) -> None:
        self.init_info: TInitT = parse_record(self.init_info_cls, init_info,
                                              where=f"{self.backend_name} trainer init info")
        self.client = client
        self.source = source
        self.connected = False
        self.closed = False

    @classmethod
    def trainer_init(cls: type[S], init_info: Any, *, client: WeightSyncClient,
                     source: WeightSource) -> S:
        """Construct and connect; a failed connect releases what it had acquired."""
        sender = cls(init_info, client=client, source=source)
        try:
            sender.connect()
        except BaseException:
            sender.shutdown()
            raise
        return sender

    def connect(self) -> None:
        """Allocate staging, form groups, and initialize every receiver behind the client."""
        if self.closed or self.connected:
            raise LifecycleError(f"{self.backend_name} sender is "
                                 f"{'shut down' if self.closed else 'already connected'}")
        receiver_init = self._connect()
        self._init_receivers(receiver_init)
        self.connected = True

    def send_weights(self, weight_version: str | None = None) -> TransferStats:
        """Send every tensor of the source: start -> update(s) -> finish on the client."""
        if self.closed or not self.connected:
            raise LifecycleError(f"{self.backend_name} sender is "
                                 f"{'shut down' if self.closed else 'not connected'}")
        metas = self.source.metadata()
        plan = BucketPlan.build(metas, self.init_info.bucket_bytes,
                                direct_threshold=self.direct_threshold)
        start = time.perf_counter()
        self.client.start_weight_update()
        try:
            self._send(plan)
        except BaseException as exc:
            self._abort_remote(exc)
            raise
        self.client.finish_weight_update(weight_version)
        seconds = time.perf_counter() - start
        return TransferStats(plan.total_bytes, len(metas), len(plan.buckets), seconds)

    def _abort_remote(self, exc: BaseException) -> None:
        """Tell receivers the update failed here, so they fail it now instead of at timeout."""
        if isinstance(exc, TransferTimeout):
            return  # a receiver that does not answer would not answer this either
        with contextlib.suppress(Exception):  # a failed receiver's own deadline covers it
            self.client.update_weights({"abort": f"{type(exc).__name__}: {exc}"[:1000]})

    def shutdown(self) -> None:
        """Free staging buffers and connections; idempotent."""
        if not self.closed:
            self.closed = True
            self._close()

    def __enter__(self: S) -> S:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    @property
    def direct_threshold(self) -> int:
        """Bytes from which a tensor becomes a direct bucket; 0 (never) unless a backend
        that can move tensors in place overrides it."""
        return 0

    def _staging_device(self, override: str | None) -> torch.device:
        """Where staging lives: the init info's `device` when given, else the source's."""
        if override:
            return torch.device(override)
        return self.source.device or torch.device("cpu")

    @abstractmethod
    def _connect(self) -> dict[str, Any]:
        """Allocate staging (and listen, where the backend does); return the receiver init
        info as plain data."""

    def _init_receivers(self, receiver_init: dict[str, Any]) -> None:
        """Send the receiver init info through the client (override to vary it per engine)."""
        self.client.init_weight_transfer_engine(receiver_init)

    @abstractmethod
    def _send(self, plan: BucketPlan) -> None:
        """Move every bucket of `plan` (client update calls included)."""

    @abstractmethod
    def _close(self) -> None:
        """Release what `_connect` acquired; must work after a partial or failed connect."""
