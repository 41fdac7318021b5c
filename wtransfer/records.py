"""The records of the lifecycle: wire parameters, init and update infos, and transfer stats.

A backend subclasses `TrainerInitInfo` (naming itself in the `backend` class attribute, which
is checked when the class is defined), `ReceiverInitInfo` and `UpdateInfo`. Dicts from the
wire become these dataclasses through `wtransfer.wire.parse_record`.
"""

from __future__ import annotations

import math
import re
import secrets
from dataclasses import asdict, dataclass
from typing import Any, ClassVar, Literal, get_args

from wtransfer.errors import ConfigError
from wtransfer.manifest import PlanParams
from wtransfer.packing import DEFAULT_ALIGN
from wtransfer.wire import check_record_types, record_to_wire

MAX_BUCKET_BYTES = 1 << 40
_SENDER_ID = re.compile(r"[0-9a-f]{8,64}")


PauseMode = Literal["abort", "wait", "keep"]
"""abort: end live requests; wait: let running ones finish; keep: freeze them for resume."""
PAUSE_MODES: tuple[str, ...] = get_args(PauseMode)


def check_pause_mode(mode: object) -> PauseMode:
    """`mode` if it is a pause mode, else `ConfigError` listing the modes."""
    if mode not in PAUSE_MODES:
        raise ConfigError(f"unknown pause mode {mode!r}; use one of {PAUSE_MODES}")
    return mode  # type: ignore[return-value]


MAX_VERSION_CHARS = 256


def check_version(version: object) -> str:
    """`version` if it is a usable weight-version label: a non-empty string of at most
    `MAX_VERSION_CHARS` printable characters (labels appear in outputs and /metrics)."""
    if not isinstance(version, str) or not version:
        raise ConfigError("weight version must be a non-empty string")
    if len(version) > MAX_VERSION_CHARS or not version.isprintable():
        raise ConfigError(f"weight version must be at most {MAX_VERSION_CHARS} printable "
                          f"characters (no newlines or control characters), got {version!r:.80}")
    return version


def new_sender_id() -> str:
    """A fresh sender identity: 128 random bits as hex (what `trainer_init` gives each sender)."""
    return secrets.token_hex(16)


def check_sender_id(value: str | None) -> None:
    """`ConfigError` unless `value` is None or a sender identity (8-64 lowercase hex digits)."""
    if value is not None and not _SENDER_ID.fullmatch(value):
        raise ConfigError(f"sender_id must be 8-64 lowercase hex digits, got {value!r:.80}")


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

    def __post_init__(self) -> None:
        check_record_types(self)
        if not DEFAULT_ALIGN <= self.bucket_bytes <= MAX_BUCKET_BYTES:
            raise ConfigError(f"bucket_bytes must be between {DEFAULT_ALIGN} and "
                              f"{MAX_BUCKET_BYTES}, got {self.bucket_bytes}")
        if not 1 <= self.num_buffers <= 16:
            raise ConfigError(f"num_buffers must be between 1 and 16, got {self.num_buffers}")
        if not (math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise ConfigError(f"timeout_s must be a positive number of seconds, "
                              f"got {self.timeout_s}")


@dataclass(frozen=True, kw_only=True)
class TrainerInitInfo(WireParams):
    """Base of every backend's trainer-side init info; `backend` picks the backend.

    A subclass must set `backend` (checked when the class is defined); an intermediate base
    that is not meant to be used itself says so with ``class X(TrainerInitInfo, abstract=True)``.
    """

    backend: ClassVar[str] = ""
    senders: int | None = None
    """Trainer ranks that send at once (each with its own client; the others pass
    client=None); default: however many ranks have a client. Checked, never sent."""
    direct_threshold: int | None = None
    """Tensors of at least this many bytes skip staging and move on their own, where the
    backend can (nccl, ucx); 0 packs everything; None lets the backend choose. The receivers
    get the resolved value in their init info's `plan`."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.direct_threshold is not None and self.direct_threshold < 0:
            raise ConfigError(f"direct_threshold must be >= 0, got {self.direct_threshold}")

    def __init_subclass__(cls, *, abstract: bool = False, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        name = getattr(cls, "backend", "")
        if not abstract and not (isinstance(name, str) and name):
            raise TypeError(f"{cls.__name__} must name its backend: add "
                            "`backend: ClassVar[str] = \"<name>\"` to the class")


@dataclass(frozen=True, kw_only=True)
class ReceiverInitInfo(WireParams):
    """Base of every backend's receiver-side init info (what the sender tells receivers)."""

    backend: str | None = None
    """The backend the sender speaks (`trainer_init` names it): an engine of another backend
    refuses the init by saying so, rather than by the fields it does not know."""
    sender_id: str | None = None
    """The identity of the sender this init comes from (`trainer_init` draws a fresh one per
    sender). Every update call of that sender carries it; once a newer init replaced this
    sender, its calls are refused before any byte is read. None: a hand-driven init, whose
    update calls are not checked."""

    plan: PlanParams | None = None
    """How both sides lay the tensor list out in buckets (`trainer_init` sends it; None: the
    default plan of `bucket_bytes`)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_sender_id(self.sender_id)
        if self.plan is not None and self.plan.bucket_bytes != self.bucket_bytes:
            raise ConfigError(f"plan.bucket_bytes ({self.plan.bucket_bytes}) must equal "
                              f"bucket_bytes ({self.bucket_bytes})")

    @property
    def plan_params(self) -> PlanParams:
        """The plan parameters: `plan`, or the default plan of `bucket_bytes`."""
        return self.plan if self.plan is not None else PlanParams(bucket_bytes=self.bucket_bytes)


@dataclass(frozen=True, kw_only=True)
class UpdateInfo:
    """Base of every backend's update info. `abort` carries a sender-side failure."""

    abort: str | None = None
    """Set by a sender that failed mid-update: the receiver fails the update with this reason."""
    sender_id: str | None = None
    """The sending sender's identity (`ReceiverInitInfo.sender_id`): a call from a sender that
    a newer init replaced is refused before any byte is read or written."""

    def __post_init__(self) -> None:
        check_sender_id(self.sender_id)


@dataclass(frozen=True, slots=True)
class TransferStats:
    """What one `send_weights` moved and how long it took, end to end."""

    bytes: int
    tensors: int
    buckets: int
    seconds: float
    gathered_peak_bytes: int = 0
    """Sharded sources: most gathered bytes this rank held at once (bounded by a bucket)."""

    @property
    def gbps(self) -> float:
        """Throughput in GB/s (10^9 bytes per second)."""
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")

    def as_dict(self) -> dict[str, Any]:
        """Plain form, including `gbps`."""
        return {**asdict(self), "gbps": self.gbps}

    def __repr__(self) -> str:
        return (f"TransferStats(bytes={self.bytes}, tensors={self.tensors}, "
                f"buckets={self.buckets}, seconds={self.seconds:.6f}, "
                f"gbps={self.gbps:.3f}, gathered_peak_bytes={self.gathered_peak_bytes})")


def receiver_init_dict(trainer: TrainerInitInfo, **extra: Any) -> dict[str, Any]:
    """The wire parameters of a trainer init info, plus backend fields, as plain data."""
    params = {k: v for k, v in record_to_wire(trainer).items()
              if k in WireParams.__dataclass_fields__}
    return {**params, **extra}
