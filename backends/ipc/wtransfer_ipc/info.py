"""The IPC backend's init and update records (what travels on the control plane)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from wtransfer.errors import ConfigError, MetadataError
from wtransfer.records import Capabilities, ReceiverInitInfo, TrainerInitInfo, UpdateInfo

CAPABILITIES = Capabilities(sender_check_s=0.2)
"""What ipc can do: an update call reads the sender's staging (or its tensors) before it is
answered; the receiver watches the sender's process."""

TRANSPORTS = ("shm", "cuda")
CUDA_BUCKET_BYTES = 1 << 30
"""The ipc sender's bucket capacity for staging in CUDA memory where the init info names none.
Handing one bucket from the trainer's process to an engine's on the same GPU costs about
0.1-0.25 ms whatever its size (the two processes' GPU work takes turns; measured on one H200,
docs/benchmarks.md), so 64 MiB buckets of a 16 GB model spend more time handing over than
copying. With `CUDA_NUM_BUFFERS` slots they cost up to 4 GiB of GPU memory."""
CUDA_NUM_BUFFERS = 4
"""The ipc sender's staging slots in CUDA memory where the init info names none (fewer when
the update has fewer buckets). With two, the trainer waits for the engine's answer and its
reads of a slot before packing the next bucket into it often enough to leave the GPU idle
between buckets: Qwen3-8B shapes on one H200 (2026-12-03, two runs), 1 GiB buckets: 2 slots
1.30x / 1.46x the time of two plain copies, 4 slots 1.11x / 1.18x (512 MiB x 4: 1.30x /
1.54x, so the slots, not the memory, are what helps)."""
STAGING_FIELDS = ("transport", "buffers", "sender_pid", "token")
"""The fields that describe one sender's staging buffers."""


@dataclass(frozen=True, kw_only=True)
class IPCTrainerInitInfo(TrainerInitInfo):
    """Trainer-side options of the IPC backend (wire parameters come from the base class)."""

    backend: ClassVar[str] = "ipc"
    device: str | None = None
    """Where staging buffers live ("cpu" -> shared memory, "cuda:N" -> CUDA IPC); default: the
    device of the source's tensors, except that a lone sender's pinned host tensors bound for
    one receiving worker stage on the process's current GPU (faster than shared memory). CUDA
    staging buckets default to `CUDA_BUCKET_BYTES`."""
    zero_copy: bool = True
    """CUDA sources: share the source tensors' own storage (exported once, again only when a
    storage changes) and let each receiver copy every tensor straight into its parameter: one
    device-to-device copy per byte and one control message per update, ordered by a CUDA IPC
    event. With several trainer ranks going M->N on CUDA, each worker copies what it keeps
    straight out of every rank's own shards the same way (`wtransfer_ipc.m2n_in_place`).
    Falls back to packed buckets for what cannot be shared (CPU or non-contiguous tensors,
    checksums, several senders gathering, sharded sources that gather)."""
    m2n: bool | None = None
    """True: each trainer rank packs only its own shards (no gathering), each box once, into
    its own staging, and each worker copies out of every rank's staging only the parts it
    keeps (`wtransfer_ipc.m2n`); every trainer rank needs a client then. False: gather each
    bucket to a sender, and every worker reads all of it. On CUDA with zero_copy on and no
    checksums, True reads every rank's shards in place instead of staging them
    (`wtransfer_ipc.m2n_in_place`). None (default): M->N where sharded ranks each hold a client
    and each holds one box of every tensor (FSDP2 x TP strided shards gather; on CUDA read
    in place, else staged), and through shared memory where one sender packs into one
    engine of several workers (1->N: each worker reads only what it keeps); else False
    (adapters, fleets, CUDA checksums; deltas of sharded ranks need nccl or ucx). A
    receiver without regions (vLLM) assembles each tensor in a full-size buffer while the
    ranks' pieces arrive (its peak memory is not measured yet)."""


@dataclass(frozen=True, kw_only=True)
class IPCInitInfo(ReceiverInitInfo):
    """What the sender tells each receiver once: the staging buffers to open."""

    transport: str
    """"shm" (POSIX shared memory segment names) or "cuda" (CUDA IPC handle records)."""
    buffers: list[Any]
    """One entry per staging buffer: a segment name, or a CUDA handle record."""
    sender_pid: int
    token: str
    """Identifies this sender's buffers (same-process receivers use them directly)."""
    senders: list[Any] | None = None
    """With several trainer ranks sending: every sender's ``{transport, buffers, sender_pid,
    token}``, in sender order (the fields above repeat sender 0's)."""
    free_events: list[Any] | None = None
    """CUDA staging of one sender: per engine worker, one IPC event handle per staging
    buffer. The worker records a buffer's event once its reads are queued and answers without
    waiting on its host; the trainer waits for it (polled, with the deadline) before packing
    the buffer again. Without it a worker waits for its reads before answering."""

    m2n: bool = False
    """The trainer ranks stage boxes of their own shards (`IPCUpdateInfo.pieces`), and each
    worker copies only what it keeps of them (`wtransfer_ipc.m2n`)."""
    sender_start: int | None = None
    """When the (lead) sender's process started, in clock ticks since boot (``/proc``): with
    `sender_pid` it names that process, so an engine that sees it can fail an open update as
    soon as the process is gone instead of after `timeout_s`."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for staging in self.stagings():
            if staging["transport"] not in TRANSPORTS:
                raise ConfigError(f"transport must be one of {TRANSPORTS}, "
                                  f"got {staging['transport']!r}")
            if len(staging["buffers"]) != self.num_buffers:
                raise ConfigError(f"buffers lists {len(staging['buffers'])} entries for "
                                  f"num_buffers={self.num_buffers}")

    def stagings(self) -> list[dict[str, Any]]:
        """Each sender's staging description, checked field by field."""
        if self.senders is None:
            return [{k: getattr(self, k) for k in STAGING_FIELDS}]
        if not 1 <= len(self.senders) <= 1024:
            raise ConfigError(f"senders lists {len(self.senders)} entries")
        out = []
        for i, entry in enumerate(self.senders):
            if not (isinstance(entry, dict) and set(entry) == set(STAGING_FIELDS)
                    and isinstance(entry["transport"], str)
                    and isinstance(entry["buffers"], list)
                    and isinstance(entry["sender_pid"], int)
                    and isinstance(entry["token"], str)):
                raise ConfigError(f"senders[{i}] must be {{transport: str, buffers: list, "
                                  "sender_pid: int, token: str}")
            out.append(entry)
        return out

    def free_events_of(self, worker_index: int) -> list[bytes] | None:
        """Worker `worker_index`'s `free_events` (one handle per staging buffer), checked."""
        if self.free_events is None:
            return None
        if self.transport != "cuda" or self.senders is not None:
            raise ConfigError("free_events order the staging reads of one sender's CUDA "
                              "buffers; this init info has "
                              f"{'several senders' if self.senders else 'shared memory'}")
        if not 0 <= worker_index < len(self.free_events):
            raise ConfigError(f"free_events lists {len(self.free_events)} worker(s); this "
                              f"receiver is worker {worker_index} of its engine (does the "
                              "client report the engine's num_workers?)")
        events = self.free_events[worker_index]
        if not (isinstance(events, list) and len(events) == self.num_buffers
                and all(isinstance(e, bytes) for e in events)):
            raise ConfigError(f"free_events[{worker_index}] must list {self.num_buffers} "
                              "event handles (bytes), one per staging buffer")
        return events


@dataclass(frozen=True, kw_only=True)
class ZeroCopyUpdate:
    """A whole update read straight out of the sender's storage (`wtransfer_ipc.zero_copy`):
    handle records of the storages the receivers do not hold yet, which storages the update
    reads, each tensor's storage and byte offset, and the sender's event after its last
    write. `used` and `layout` are packed signed 64-bit integers in the host's byte order
    (both processes share a host), so an unchanged one is compared, not walked."""

    storages: list[tuple[int, list[Any]]]
    """``[index, handle record]`` of each storage the receivers do not hold yet."""
    used: bytes
    """The indices of every storage the update reads."""
    layout: bytes
    """Each tensor's storage index (-1 for an empty tensor) and byte offset."""
    event: bytes
    """IPC handle of the event recorded after the trainer's last write."""
    token: str
    """The sender's buffer namespace (a new one: nothing opened before is its)."""
    sender_pid: int

    def __post_init__(self) -> None:
        if len(self.storages) > 1 << 20:
            raise MetadataError(f"zero_copy lists {len(self.storages)} storages")
        for name in ("used", "layout"):
            if len(getattr(self, name)) % 8:
                raise MetadataError(f"zero_copy {name} must be packed 64-bit integers")


@dataclass(frozen=True, kw_only=True)
class RankInPlace:
    """One trainer rank's part of an M->N update read in place (`wtransfer_ipc.m2n_in_place`):
    its local shards' zero-copy record (the layout lists each tensor's local shard), and the
    pieces the workers take from it, each offset counted in its local tensor."""

    zero_copy: ZeroCopyUpdate
    pieces: list[Any]
    """``[[tensor_index, offsets, lengths, offset, nbytes], ...]``."""


@dataclass(frozen=True, kw_only=True)
class IPCUpdateInfo(UpdateInfo):
    """One bucket, ready in staging buffer `buffer` (the first also announces the tensors)."""

    tensors: list[Any] | None = None
    """``[[name, dtype, shape], ...]`` of the whole update; sent with the first bucket."""
    tensors_digest: str | None = None
    """Instead of `tensors`, in a zero-copy update: `wtransfer.wire.digest` of the list this
    receiver got last (a trainer sends the same list every step)."""
    buffer: int = 0
    nbytes: int = 0
    slices: list[Any] = field(default_factory=list)
    """``[[tensor_index, tensor_offset, offset, nbytes], ...]`` placed in this bucket."""
    checksum: int | None = None
    event: bytes | None = None
    """CUDA staging: the IPC handle of the sender's event recorded after it packed the buffer;
    the receiver's stream waits on it before reading."""
    sender: int = 0
    """With several senders: whose staging buffers hold the bucket."""
    pieces: list[Any] | None = None
    """An M->N bucket instead of `slices`: ``[[tensor_index, offsets, lengths, offset,
    nbytes], ...]``, each a box of a tensor staged at `offset` (`wtransfer_ipc.m2n`)."""
    zero_copy: ZeroCopyUpdate | None = None
    """The whole update straight from the sender's storage (one call per update)."""
    in_place_ranks: list[RankInPlace] | None = None
    """An M->N update read straight out of every trainer rank's shards, in rank order (one
    call per update, the lead's)."""
