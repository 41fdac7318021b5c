"""The backend-neutral lifecycle: receiver and sender ABCs, their info records, and stats.

Receiver state machine (one `WeightTransferEngine` per model worker)::

    new --init--> ready --start--> updating --finish--> ready
                    ^                  |  error / abort / abandoned
                    |                  v
                    +---- start --- failed          (any state) --shutdown--> closed

`init` may be repeated from ready or failed (new wire parameters replace the old ones).
Public methods are template methods: parse dicts into the backend's dataclasses, check the
state, then call the backend's ``_init / _start / _receive / _finish / _shutdown`` hooks.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

import torch

from wtransfer.errors import ConfigError, LifecycleError, PeerError, TransferTimeout
from wtransfer.packing import DEFAULT_ALIGN, BucketPlan
from wtransfer.receiving import UpdateSession
from wtransfer.target import WeightTarget
from wtransfer.wire import parse_record, record_to_wire

if TYPE_CHECKING:
    from wtransfer.clients import WeightSyncClient
    from wtransfer.source import WeightSource

MAX_BUCKET_BYTES = 1 << 40


@dataclass(frozen=True, kw_only=True)
class WireParams:
    """Transfer parameters the trainer chooses; they travel once, at init, to every receiver."""

    bucket_bytes: int = 64 << 20
    """Capacity of one staging bucket in bytes; staging memory is num_buffers x this per side."""
    num_buffers: int = 2
    """Staging buffers per side; 2 lets packing bucket k+1 overlap moving bucket k."""
    checksum: bool = False
    """Checksum every bucket on the sender and verify it on each receiver."""
    timeout_s: float = 60.0
    """Deadline of every blocking wait of the transfer, in seconds."""
    direct_threshold: int | None = None
    """Tensors of at least this many bytes skip staging and move on their own, where the
    backend can (nccl); 0 packs everything; None lets the backend choose."""

    def __post_init__(self) -> None:
        if not DEFAULT_ALIGN <= self.bucket_bytes <= MAX_BUCKET_BYTES:
            raise ConfigError(f"bucket_bytes must be between {DEFAULT_ALIGN} and "
                              f"{MAX_BUCKET_BYTES}, got {self.bucket_bytes}")
        if not 1 <= self.num_buffers <= 16:
            raise ConfigError(f"num_buffers must be between 1 and 16, got {self.num_buffers}")
        if self.direct_threshold is not None and self.direct_threshold < 0:
            raise ConfigError(f"direct_threshold must be >= 0, got {self.direct_threshold}")
        if not (math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise ConfigError(f"timeout_s must be a positive number of seconds, "
                              f"got {self.timeout_s}")


@dataclass(frozen=True, kw_only=True)
class TrainerInitInfo(WireParams):
    """Base of every backend's trainer-side init info; `backend` picks the backend."""

    backend: ClassVar[str] = ""


@dataclass(frozen=True, kw_only=True)
class ReceiverInitInfo(WireParams):
    """Base of every backend's receiver-side init info (what the sender tells receivers)."""


@dataclass(frozen=True, kw_only=True)
class UpdateInfo:
    """Base of every backend's update info. `abort` carries a sender-side failure."""

    abort: str | None = None
    """Set by a sender that failed mid-update: the receiver fails the update with this reason."""


@dataclass(frozen=True, slots=True)
class TransferStats:
    """What one `send_weights` moved and how long it took, end to end."""

    bytes: int
    tensors: int
    buckets: int
    seconds: float

    @property
    def gbps(self) -> float:
        """Throughput in GB/s (10^9 bytes per second)."""
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")

    def as_dict(self) -> dict[str, Any]:
        """Plain form, including `gbps`."""
        return {**asdict(self), "gbps": self.gbps}


InitT = TypeVar("InitT", bound=ReceiverInitInfo)
UpdateT = TypeVar("UpdateT", bound=UpdateInfo)
TInitT = TypeVar("TInitT", bound=TrainerInitInfo)


class WeightTransferEngine(ABC, Generic[InitT, UpdateT]):
    """Receiver ABC (see the module docstring for the state machine)."""

    backend_name: ClassVar[str]
    init_info_cls: ClassVar[type]
    update_info_cls: ClassVar[type]
    worker_index: int = 0
    """Index of this receiver among its engine's workers (a data-parallel engine sets its rank);
    collective backends derive the receiver's group rank from it."""

    def __init__(self, target: WeightTarget, *, device: str | torch.device = "cpu") -> None:
        self.target = target
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.init_info: InitT | None = None
        self.failure: str | None = None
        """Why the last update failed, while the state is "failed"."""
        self.torn = False
        """True when the last update failed after changing some weights (and none since)."""
        self.last_update_bytes = 0
        self.last_update_seconds = 0.0
        self._state = "new"
        self._session: UpdateSession | None = None
        self._lock = threading.RLock()
        self._busy = False
        self._last_call = time.monotonic()
        self._started = 0.0

    # -- state ---------------------------------------------------------------------------

    @property
    def state(self) -> str:
        """One of "new", "ready", "updating", "failed", "closed"."""
        if self._state == "updating" and not self._busy and self.init_info is not None:
            idle = time.monotonic() - self._last_call
            if idle > self.init_info.timeout_s:
                with self._lock:
                    if self._state == "updating" and not self._busy:
                        self._fail(f"update abandoned: no call from the sender for {idle:.1f}s "
                                   f"(timeout_s={self.init_info.timeout_s})")
        return self._state

    def _require(self, *states: str, action: str) -> None:
        state = self.state
        if state not in states:
            hint = {
                "new": "call init_transfer_engine first",
                "closed": "this engine was shut down; create a new one",
                "updating": "an update is open; finish it first",
                "failed": f"the last update failed ({self.failure}); call start_weight_update",
                "ready": "call start_weight_update first",
            }[state]
            raise LifecycleError(f"{self.backend_name}: cannot {action} in state "
                                 f"'{state}': {hint}")

    def _fail(self, reason: str) -> None:
        self.failure = reason
        self.torn = bool(self._session and self._session.touched)
        self._session = None
        self._state = "failed"
        with contextlib.suppress(Exception):  # teardown must not mask the original failure
            self._abort()

    def _call(self) -> _CallGuard:
        return _CallGuard(self)

    # -- public template methods ---------------------------------------------------------

    def init_transfer_engine(self, init_info: InitT | Mapping[str, Any]) -> None:
        """Parse and apply the sender's init info (staging handles, wire parameters)."""
        with self._call():
            self._require("new", "ready", "failed", action="init the transfer engine")
            info: InitT = parse_record(self.init_info_cls, init_info,
                                       where=f"{self.backend_name} init info")
            if self.init_info is not None:
                self._shutdown()
                self.init_info = None
            self._init(info)
            self.init_info = info
            if self._state == "new":
                self._state = "ready"

    def start_weight_update(self) -> None:
        """Open an update; weights change only between this and `finish_weight_update`."""
        with self._call():
            self._require("ready", "failed", action="start a weight update")
            self._session = UpdateSession(self.target, self.device)
            self._start()
            self.failure = None
            self._state = "updating"
            self._started = time.monotonic()

    def update_weights(self, update_info: UpdateT | Mapping[str, Any]) -> None:
        """Receive one part of the update (a backend may be called any number of times)."""
        with self._call():
            self._require("updating", action="update weights")
            assert self._session is not None
            try:
                info: UpdateT = parse_record(self.update_info_cls, update_info,
                                             where=f"{self.backend_name} update info")
                if info.abort is not None:
                    raise PeerError(f"sender aborted the update: {info.abort}")
                self._receive(info, self._session)
            except BaseException as exc:
                self._fail(f"{type(exc).__name__}: {exc}")
                raise

    def finish_weight_update(self) -> None:
        """Check the update is complete, run backend and target post-processing, close it."""
        with self._call():
            self._require("updating", action="finish a weight update")
            session = self._session
            assert session is not None
            try:
                session.finish()
                self._finish()
                self.target.finish()
            except BaseException as exc:
                self._fail(f"{type(exc).__name__}: {exc}")
                raise
            self.last_update_bytes = session.bytes_received
            self.last_update_seconds = time.monotonic() - self._started
            self._session = None
            self.torn = False
            self._state = "ready"

    def shutdown(self) -> None:
        """Release every resource (staging buffers, groups); idempotent."""
        with self._lock:
            if self._state == "closed":
                return
            if self.init_info is not None:
                self._shutdown()
            self._session = None
            self._state = "closed"

    # -- backend hooks -------------------------------------------------------------------

    @abstractmethod
    def _init(self, info: InitT) -> None:
        """Open staging buffers / groups described by `info`."""

    def _start(self) -> None:
        """Per-update preparation; optional."""

    @abstractmethod
    def _receive(self, info: UpdateT, session: UpdateSession) -> None:
        """Receive the buckets `info` describes and hand them to `session.consume`."""

    def _finish(self) -> None:
        """Backend post-processing after all buckets arrived; optional."""

    def _abort(self) -> None:
        """Drop per-update state after a failure; optional."""

    @abstractmethod
    def _shutdown(self) -> None:
        """Release what `_init` acquired."""


class _CallGuard:
    """Marks the engine busy during a public call and records the time of the last call."""

    def __init__(self, engine: WeightTransferEngine[Any, Any]) -> None:
        self.engine = engine

    def __enter__(self) -> None:
        self.engine._lock.acquire()
        self.engine._busy = True

    def __exit__(self, *exc: object) -> None:
        self.engine._last_call = time.monotonic()
        self.engine._busy = False
        self.engine._lock.release()


class TrainerTransferEngine(ABC, Generic[TInitT]):
    """Sender ABC: set up at construction, then `send_weights` any number of times."""

    backend_name: ClassVar[str]
    init_info_cls: ClassVar[type]

    def __init__(
        self, init_info: TInitT, *, client: WeightSyncClient, source: WeightSource
    ) -> None:
        self.init_info: TInitT = parse_record(self.init_info_cls, init_info,
                                              where=f"{self.backend_name} trainer init info")
        self.client = client
        self.source = source
        self._closed = False
        receiver_init = self._setup()
        try:
            self._init_receivers(receiver_init)
        except BaseException:
            self._teardown()
            raise

    def send_weights(self, weight_version: str | None = None) -> TransferStats:
        """Send every tensor of the source: start -> update(s) -> finish on the client."""
        if self._closed:
            raise LifecycleError(f"{self.backend_name} sender is shut down")
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
        if not self._closed:
            self._closed = True
            self._teardown()

    def __enter__(self) -> TrainerTransferEngine[TInitT]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    @property
    def direct_threshold(self) -> int:
        """Bytes from which a tensor becomes a direct bucket; 0 (never) unless a backend
        that can move tensors in place overrides it."""
        return 0

    @abstractmethod
    def _setup(self) -> dict[str, Any]:
        """Allocate staging; return the receiver init info as plain data."""

    def _staging_device(self, override: str | None) -> torch.device:
        """Where staging lives: the init info's `device` when given, else the source's."""
        if override:
            return torch.device(override)
        return self.source.device or torch.device("cpu")

    def _init_receivers(self, receiver_init: dict[str, Any]) -> None:
        """Send the receiver init info through the client (override to vary it per client)."""
        self.client.init_weight_transfer_engine(receiver_init)

    @abstractmethod
    def _send(self, plan: BucketPlan) -> None:
        """Move every bucket of `plan` (client update calls included)."""

    @abstractmethod
    def _teardown(self) -> None:
        """Release what `_setup` acquired."""


def receiver_init_dict(trainer: TrainerInitInfo, **extra: Any) -> dict[str, Any]:
    """The wire parameters of a trainer init info, plus backend fields, as plain data."""
    params = {k: v for k, v in record_to_wire(trainer).items()
              if k in WireParams.__dataclass_fields__ and k != "direct_threshold"}
    return {**params, **extra}
