"""The records of the lifecycle: wire parameters, init and update infos, transfer stats, and
layouts.

A backend subclasses `TrainerInitInfo` (naming itself in the `backend` class attribute, which
is checked when the class is defined), `ReceiverInitInfo` and `UpdateInfo`. Dicts from the
wire become these dataclasses through `wtransfer.wire.parse_record`.

Layouts say which part of each tensor a rank holds. A sharded engine worker (or trainer rank)
holds a slice of a tensor: one box of it, or several boxes laid side by side (a
tensor-parallel rank of a fused ``gate_up_proj`` holds its rows of the gate and of the up
projection). A `TensorLayout` says so for one tensor: its global name, shape and dtype, the
`Box`es held, and how the local tensor is made of them (concatenated along `concat_dim`, in
order); `replica` tells copies of the same boxes on several ranks apart.
"""

from __future__ import annotations

import dataclasses
import math
import re
import secrets
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar, Literal, get_args

import torch

from wtransfer.errors import ConfigError, MetadataError
from wtransfer.manifest import PlanParams
from wtransfer.packing import DEFAULT_ALIGN, DTYPES
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
class Capabilities:
    """What a backend can do beyond the hooks it implements, declared once: its sender and
    receiver classes both hold the same record (`capabilities`)."""

    pair_deltas: bool = False
    """M->N moves each pair bucket as a message of its own, which a delta encodes
    (`wtransfer.delta.pieces`)."""
    calls_read_sender_memory: bool = True
    """The sender reuses the memory an update call reads (a staging slot, its own tensors)
    once the call is answered, so the call must have read it before it returns (ipc). False
    where the data plane tells the sender when bytes moved (nccl, ucx): a staged engine may
    then run such a call on a thread of its own and answer at once."""
    sender_check_s: float | None = None
    """How often the receiver's deadline timer asks `_sender_gone` while an open update waits
    for the sender's next call; None where the receiver cannot tell (the update then waits
    `timeout_s`)."""


LEGACY_CAPABILITY_NAMES = ("takes_pair_deltas", "calls_read_sender_memory", "sender_check_s")
"""The class attributes backends set before `Capabilities` (still read, deprecated)."""


SENDER_LEGACY_CAPABILITIES = {"takes_pair_deltas": "pair_deltas"}
"""The class attributes senders declared capabilities with before `Capabilities`, by field."""


def declared_capabilities(cls: type, legacy: Mapping[str, str]) -> Capabilities:
    """`cls`'s capabilities, with any `legacy` class attribute it sets itself (an old name
    -> its `Capabilities` field: how backends declared them before the record) folded in,
    with a DeprecationWarning."""
    own = {field: vars(cls)[name] for name, field in legacy.items() if name in vars(cls)}
    record: Capabilities = getattr(cls, "capabilities", Capabilities())
    if not own:
        return record
    warnings.warn(f"{cls.__name__} sets {sorted(n for n in legacy if n in vars(cls))} as "
                  f"class attributes; declare `capabilities = Capabilities(...)` instead",
                  DeprecationWarning, stacklevel=4)  # (the class statement, past ABCMeta)
    return dataclasses.replace(record, **own)


DEFAULT_BUCKET_BYTES = 64 << 20
"""Staging bucket capacity where neither the trainer nor its backend chose one."""
DEFAULT_NUM_BUFFERS = 2
"""Staging buffers per side where neither the trainer nor its backend chose how many."""


@dataclass(frozen=True, kw_only=True)
class WireParams:
    """Transfer parameters the trainer chooses; they travel once, at init, to every receiver."""

    bucket_bytes: int | None = None
    """Capacity of one staging bucket in bytes; staging memory is num_buffers x this per side.
    None: the backend's choice, `DEFAULT_BUCKET_BYTES` except where its staging says otherwise
    (ipc staging in CUDA memory: `wtransfer_ipc.CUDA_BUCKET_BYTES`)."""
    num_buffers: int | None = None
    """Staging buffers per side; 2 lets packing bucket k+1 overlap moving bucket k. None: the
    backend's choice, `DEFAULT_NUM_BUFFERS` except where its staging says otherwise (ipc
    staging in CUDA memory: up to `wtransfer_ipc.CUDA_NUM_BUFFERS`)."""
    checksum: bool = False
    """Checksum every bucket on the sender and verify it on each receiver."""
    timeout_s: float = 60.0
    """Deadline of every blocking wait of the transfer, in seconds."""
    delta: bool = False
    """After a first full update, send only the elements whose bits changed since the last
    update the receivers hold, proven by a base token (`wtransfer.delta`): one sender with an
    unsharded source diffs each tensor; with a sharded source every rank diffs its own pair
    buckets of an M->N transfer (nccl, ucx: `wtransfer.delta.pieces`)."""
    allow_non_finite: bool = False
    """Let NaN and infinite values go live. By default a receiver refuses an update holding
    one before it goes live (`NonFiniteError`, naming the tensor): a diverged step never
    reaches the engine."""

    def __post_init__(self) -> None:
        check_record_types(self)
        if self.bucket_bytes is not None and not (DEFAULT_ALIGN <= self.bucket_bytes
                                                  <= MAX_BUCKET_BYTES):
            raise ConfigError(f"bucket_bytes must be between {DEFAULT_ALIGN} and "
                              f"{MAX_BUCKET_BYTES}, got {self.bucket_bytes}")
        if self.num_buffers is not None and not 1 <= self.num_buffers <= 16:
            raise ConfigError(f"num_buffers must be between 1 and 16, got {self.num_buffers}")
        if not (math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise ConfigError(f"timeout_s must be a positive number of seconds, "
                              f"got {self.timeout_s}")


@dataclass(frozen=True, kw_only=True)
class TrainerInitInfo(WireParams):
    """Base of every backend's trainer-side init info; `backend` picks the backend. A subclass must
    set it (checked when the class is defined), unless it is an intermediate base declared with
    ``class X(TrainerInitInfo, abstract=True)``."""

    backend: ClassVar[str] = ""
    per_rank_fields: ClassVar[frozenset[str]] = frozenset(
        {"device", "delta_copy_device", "listen_address", "listen_port"})
    """Fields each trainer rank sets for itself (its GPU, where it listens); every other
    field must be the same on all ranks that send together (checked at connect)."""
    senders: int | None = None
    """Trainer ranks that send at once (each with its own client; the others pass
    client=None); default: however many ranks have a client. Checked, never sent."""
    direct_threshold: int | None = None
    """Tensors of at least this many bytes skip staging and move on their own, where the
    backend can (nccl, ucx); 0 packs everything; None lets the backend choose. The receivers
    get the resolved value in their init info's `plan`."""
    delta_copy_device: str = "cpu"
    """With `delta`: where the sender keeps its last-sent copy of the weights to diff against
    (one model's size, reported as `TransferStats.delta_base_bytes`): "cpu" (host memory) or
    a device such as "cuda:0" (the compare runs there: faster, at the price of device
    memory). Checked, never sent."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.direct_threshold is not None and self.direct_threshold < 0:
            raise ConfigError(f"direct_threshold must be >= 0, got {self.direct_threshold}")
        try:
            device = torch.device(self.delta_copy_device)
        except (RuntimeError, ValueError):
            device = None
        if device is None or device.type not in ("cpu", "cuda"):
            raise ConfigError(f"delta_copy_device must be 'cpu' or a CUDA device such as "
                              f"'cuda:0', got {self.delta_copy_device!r:.80}")

    def __init_subclass__(cls, *, abstract: bool = False, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        name = getattr(cls, "backend", "")
        if not abstract and not (isinstance(name, str) and name):
            raise TypeError(f"{cls.__name__} must name its backend: add "
                            "`backend: ClassVar[str] = \"<name>\"` to the class")


@dataclass(frozen=True, kw_only=True)
class ReceiverInitInfo(WireParams):
    """Base of every backend's receiver-side init info (what the sender tells receivers)."""

    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    """Capacity of one staging bucket in bytes (the sender's, resolved)."""
    num_buffers: int = DEFAULT_NUM_BUFFERS
    """Staging buffers per side (the sender's, resolved)."""
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


_DELTA_TOKEN = re.compile(r"[0-9a-f]{32}")


@dataclass(frozen=True, kw_only=True)
class DeltaHeader:
    """What a delta-enabled sender's update says about itself in its first update call: `token`, its
    identity, which receivers that finish it hold as their base, and `base` (None for a full
    update), the token a receiver must hold for the update to apply at all."""

    token: str
    """This update's identity (128 random bits, hex)."""
    base: str | None = None
    """The token of the update whose weights this delta applies onto; None: a full update."""
    entries: list[Any] = field(default_factory=list)
    """A delta's changed tensors (`DeltaEntry.to_wire` forms), in the order they travel."""
    by_piece: bool = False
    """An update of an M->N transfer: a delta's pair buckets carry their pieces' changed
    elements (`wtransfer.delta.pieces`; `entries` stays empty)."""

    def __post_init__(self) -> None:
        for token in (self.token, self.base):
            if token is not None and not (isinstance(token, str)
                                          and _DELTA_TOKEN.fullmatch(token)):
                raise MetadataError(f"delta token must be 32 lowercase hex digits, got "
                                    f"{token!r:.80}")
        if (self.base is None or self.by_piece) and self.entries:
            raise MetadataError("a full update (no base), or a delta of an M->N transfer, "
                                "carries no delta entries")


@dataclass(frozen=True, kw_only=True)
class UpdateInfo:
    """Base of every backend's update info. `abort` carries a sender-side failure."""

    abort: str | None = None
    """Set by a sender that failed mid-update: the receiver fails the update with this reason."""
    sender_id: str | None = None
    """The sending sender's identity (`ReceiverInitInfo.sender_id`): a call from a sender that
    a newer init replaced is refused before any byte is read or written."""
    delta: DeltaHeader | None = None
    """A delta-enabled sender's header call (the update's first, carrying nothing else): the
    update's token and, for a delta, the base it applies onto (`wtransfer.delta`)."""

    def __post_init__(self) -> None:
        check_sender_id(self.sender_id)


BATCHED_CALLS: dict[str, tuple[str, ...]] = {
    "start_weight_update": (), "update_weights": ("update_info",),
    "stage_weight_update": (), "discard_weight_update": ("reason",),
    "finish_weight_update": ("weight_version",)}
"""The weight-sync calls one request may carry (`wtransfer serve`'s ``POST /weight_calls``),
with the body fields each takes (those of its own route)."""
MAX_BATCHED_CALLS = 4096
"""Most calls one batch may carry."""


@dataclass(frozen=True, kw_only=True)
class WeightCall:
    """One call of a batch on the wire: the method, its own route's body (msgpack; empty:
    none), and `after`, the index of the earlier call of the batch it runs after, only if
    that one succeeded (None: it runs whatever came before)."""

    method: str
    body: bytes = b""
    after: int | None = None

    def __post_init__(self) -> None:
        if self.method not in BATCHED_CALLS:
            raise ConfigError(f"{self.method!r} cannot be batched; the calls a batch may carry "
                              f"are {sorted(BATCHED_CALLS)}")
        if self.after is not None and self.after < 0:
            raise ConfigError(f"after must be the index of an earlier call, got {self.after}")


@dataclass(frozen=True, kw_only=True)
class CallOutcome:
    """The answer to one call of a batch: its HTTP status (what the call alone would have
    answered) and, for a failure, the error's type and message."""

    status: int
    error: str | None = None
    message: str | None = None


@dataclass(frozen=True, slots=True)
class TransferStats:
    """What one `send_weights` moved and how long it took, end to end."""

    bytes: int
    tensors: int
    buckets: int
    seconds: float
    gathered_peak_bytes: int = 0
    """Sharded sources: most gathered bytes this rank held at once (bounded by a bucket)."""
    sent_bytes: int | None = None
    """M->N: tensor bytes this trainer rank sent (its part of `bytes`, replicas shared)."""
    worker_bytes: list[int] | None = None
    """M->N: tensor bytes each worker received (what it keeps), in worker order."""
    wire_bytes: int | None = None
    """Delta-enabled senders: tensor bytes that moved (`bytes` is the model bytes the update
    stands for; a delta moves only the changed elements)."""
    changed_fraction: float | None = None
    """Delta updates: the fraction of the model's elements whose bits changed."""
    delta_base_bytes: int = 0
    """Delta-enabled senders: bytes of the last-sent copy the sender keeps to diff against."""
    dropped: list[str] | None = None
    """A fleet in drop mode (`FanoutClient(on_failure="drop")`): the instances that failed
    this update and left the fleet (None: the client is no such fleet)."""

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
                f"gbps={self.gbps:.3f}, gathered_peak_bytes={self.gathered_peak_bytes}"
                + (f", sent_bytes={self.sent_bytes}, worker_bytes={self.worker_bytes}"
                   if self.worker_bytes is not None else "")
                + (f", wire_bytes={self.wire_bytes}, changed_fraction={self.changed_fraction}"
                   if self.wire_bytes is not None else "") + ")")


def receiver_init_dict(trainer: TrainerInitInfo, **extra: Any) -> dict[str, Any]:
    """The wire parameters of a trainer init info, plus backend fields, as plain data."""
    params = {k: v for k, v in record_to_wire(trainer).items()
              if k in WireParams.__dataclass_fields__}
    return {**params, **extra}


# -- layouts ---------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class Box:
    """A rectangular part of a tensor: per dimension, where it starts and how long it is."""

    offsets: tuple[int, ...]
    lengths: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.offsets) != len(self.lengths):
            raise MetadataError(f"a box needs one offset per length, got {self.offsets} and "
                                f"{self.lengths}")
        if any(o < 0 for o in self.offsets) or any(n < 0 for n in self.lengths):
            raise MetadataError(f"box offsets and lengths must be >= 0, got {self}")

    @classmethod
    def whole(cls, shape: Sequence[int]) -> Box:
        """The box of a whole tensor of `shape`."""
        return cls(offsets=(0,) * len(shape), lengths=tuple(shape))

    def slices(self) -> tuple[slice, ...]:
        """Index of this box in the full tensor."""
        return tuple(slice(o, o + n) for o, n in zip(self.offsets, self.lengths, strict=True))

    @property
    def numel(self) -> int:
        """Elements in the box."""
        return math.prod(self.lengths)

    def slices_in(self, outer: Box) -> tuple[slice, ...]:
        """Index of this box (inside `outer`) in a tensor holding just `outer`."""
        return tuple(slice(p - b, p - b + n) for p, b, n in zip(
            self.offsets, outer.offsets, self.lengths, strict=True))

    def intersect(self, other: Box) -> Box | None:
        """The part of this box inside `other`, or None when they do not overlap."""
        starts = [max(a, b) for a, b in zip(self.offsets, other.offsets, strict=True)]
        ends = [min(a + n, b + m) for a, n, b, m in zip(self.offsets, self.lengths,
                                                        other.offsets, other.lengths,
                                                        strict=True)]
        if any(e <= st for st, e in zip(starts, ends, strict=True)):
            return None
        return Box(offsets=tuple(starts), lengths=tuple(e - st for st, e in zip(starts, ends,
                                                                                strict=True)))

    def overlaps(self, other: Box) -> bool:
        """Whether this box and `other` share an element (`intersect` without building it)."""
        return all(a < b + m and b < a + n and n and m for a, n, b, m in zip(
            self.offsets, self.lengths, other.offsets, other.lengths, strict=True))

    def inside(self, other: Box) -> bool:
        """Whether every element of this box lies in `other`."""
        return all(b <= a and a + n <= b + m for a, n, b, m in zip(
            self.offsets, self.lengths, other.offsets, other.lengths, strict=True))

    def within(self, shape: Sequence[int]) -> bool:
        """Whether the box lies inside a tensor of `shape`."""
        return len(shape) == len(self.offsets) and all(
            o + n <= s for o, n, s in zip(self.offsets, self.lengths, shape, strict=True))


@dataclass(frozen=True, kw_only=True)
class TensorLayout:
    """The part of global tensor `name` (`shape`, `dtype`) one rank holds (see the module
    docstring)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    boxes: tuple[Box, ...]
    concat_dim: int = 0
    """The local tensor is the boxes concatenated along this dimension, in order."""
    replica: int = 0
    """Which copy of these boxes this is among the ranks that hold the same ones."""

    def __post_init__(self) -> None:
        if not self.boxes:
            raise MetadataError(f"layout of {self.name!r} holds no box")
        bad = [b for b in self.boxes if not b.within(self.shape)]
        if bad:
            raise MetadataError(f"layout of {self.name!r}: box {bad[0]} lies outside "
                                f"{list(self.shape)}")
        if len(self.boxes) > 1 and not 0 <= self.concat_dim < len(self.shape):
            raise MetadataError(f"layout of {self.name!r}: concat_dim {self.concat_dim} out "
                                f"of range")

    @classmethod
    def whole(cls, name: str, dtype: str, shape: Sequence[int], replica: int = 0
              ) -> TensorLayout:
        """The layout of a rank holding all of a tensor."""
        return cls(name=name, dtype=dtype, shape=tuple(shape), boxes=(Box.whole(shape),),
                   replica=replica)

    @property
    def is_whole(self) -> bool:
        """Whether this rank holds the whole tensor."""
        if len(self.boxes) != 1:
            return False
        box = self.boxes[0]
        return box.lengths == tuple(self.shape) and not any(box.offsets)

    @property
    def local_shape(self) -> tuple[int, ...]:
        """The shape of the tensor this rank holds."""
        first = list(self.boxes[0].lengths)
        if len(self.boxes) > 1:
            first[self.concat_dim] = sum(b.lengths[self.concat_dim] for b in self.boxes)
        return tuple(first)

    @property
    def numel(self) -> int:
        """Elements this rank holds."""
        return sum(b.numel for b in self.boxes)

    @property
    def nbytes(self) -> int:
        """Bytes this rank holds."""
        return self.numel * DTYPES[self.dtype].itemsize

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of the full tensor `full` (a view when it is one box)."""
        if tuple(full.shape) != self.shape:
            raise MetadataError(f"{self.name!r}: full tensor of shape {list(full.shape)}, the "
                                f"layout says {list(self.shape)}")
        parts = [full[b.slices()] for b in self.boxes]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=self.concat_dim)

    def view(self, local: torch.Tensor, region: Box) -> torch.Tensor:
        """The part of the local tensor that holds global `region` (which must lie inside one
        of this layout's boxes): a view, so writing it writes the local tensor."""
        start = 0
        for box in self.boxes:
            width = box.lengths[self.concat_dim] if len(self.boxes) > 1 else 0
            if all(b0 <= r0 and r0 + rn <= b0 + bn for b0, bn, r0, rn in zip(
                    box.offsets, box.lengths, region.offsets, region.lengths, strict=True)):
                piece = local if len(self.boxes) == 1 else local.narrow(self.concat_dim, start,
                                                                         width)
                index = tuple(slice(r0 - b0, r0 - b0 + rn) for b0, r0, rn in zip(
                    box.offsets, region.offsets, region.lengths, strict=True))
                return piece[index]
            start += width
        raise MetadataError(f"{self.name!r}: region {region} lies in none of this rank's boxes")

    def place(self, local: torch.Tensor, full: torch.Tensor) -> None:
        """Write the local tensor's boxes into the full tensor `full`."""
        start = 0
        for box in self.boxes:
            width = box.lengths[self.concat_dim] if len(self.boxes) > 1 else 0
            piece = (local if len(self.boxes) == 1
                     else local.narrow(self.concat_dim, start, width))
            full[box.slices()] = piece
            start += width
