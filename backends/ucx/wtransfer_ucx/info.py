"""The UCX backend's init and update records."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from wtransfer.errors import ConfigError, MetadataError
from wtransfer.records import Capabilities, ReceiverInitInfo, TrainerInitInfo, UpdateInfo

CAPABILITIES = Capabilities(pair_deltas=True, calls_read_sender_memory=False,
                            sender_check_s=0.2)
"""What ucx can do: M->N pair buckets as messages of their own; the data plane paces the
sender; the receiver watches its endpoint."""


@dataclass(frozen=True, kw_only=True)
class UCXTrainerInitInfo(TrainerInitInfo):
    """Trainer side. The trainer listens at `listen_address:listen_port` (0 picks a free port)
    and every engine worker connects to it during init; in an M->N transfer (`m2n`) every
    trainer rank listens (each on a port of its own when `listen_port` is 0) and every worker
    connects to each of them."""

    backend: ClassVar[str] = "ucx"
    listen_address: str = "127.0.0.1"
    """The address workers connect to: this host's address on the network they share."""
    listen_port: int = 0
    device: str | None = None
    """Staging device; default the source's (CUDA buffers move device to device when UCX was
    built with CUDA support)."""
    rma: bool | None = None
    """Let each engine worker read every tensor straight out of the trainer's memory into its
    parameter (UCX remote memory access through UCXX's handles; see
    `wtransfer_ucx.remote_reads`): one control call per update and no staging on either
    side; otherwise tagged buckets move the update. Reads apply with one unsharded sender,
    no checksums and contiguous tensors. None (default): reads where they are known to be
    fast, that is the trainer's tensors are on CUDA, this UCX loaded its cuda_ipc transport,
    and `listen_address` is a loopback address (every worker that reaches it runs on this
    host, where cuda_ipc reads the trainer's GPU memory); tagged buckets elsewhere.
    Measured: Qwen3-8B on one H200 11.0 ms against 30.9 ms tagged (0.75 of one raw send);
    across two H200s with NVLink 0.91, as tagged; host memory over TCP 0.90 against 0.83.
    True across hosts only where RDMA with GPUDirect reaches the trainer's GPU: without a
    transport that reads remote memory UCX emulates the reads about 100x slower (not
    measured across hosts). M->N (`m2n`): True lets each worker read its pair buckets out
    of every rank's own shards (`wtransfer_ucx.m2n_reads`; not with checksums or deltas);
    None keeps tagged pair buckets there (a box that is not contiguous in a rank's shard,
    such as a rank's rows of the columns a worker keeps, takes one read per row).
    `UCXSender.reads` says which way the updates go, and why."""
    m2n: bool | None = None
    """Send each worker only what it keeps, from the trainer ranks that hold it, without
    gathering (`wtransfer_ucx.m2n`): every trainer rank needs a client then. None (default):
    when the source is sharded and every trainer rank has a client, and for a lone sender of
    a whole model into one engine of several workers where it sends tagged buckets (1->N:
    every worker gets a copy of each bucket of its own anyway, so a TP worker is sent only its
    part; where one-sided reads apply they stay the default, unmeasured against 1->N; a fleet
    keeps tagged buckets); False: one rank with a client gathers each bucket and sends it to
    every worker."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 <= self.listen_port <= 65535:
            raise ConfigError(f"listen_port must be in 0..65535, got {self.listen_port}")


@dataclass(frozen=True, kw_only=True)
class UCXInitInfo(ReceiverInitInfo):
    """What each worker gets: where the trainer listens, and this sender's session id."""

    trainer_address: str
    trainer_port: int
    session: int
    """16-bit id in every tag, so messages of an earlier sender can never match."""
    m2n: bool = False
    """An M->N transfer (`wtransfer_ucx.m2n`): the worker connects to every trainer rank
    (`trainers`), tells each what it keeps, and receives only that, from every rank."""
    trainers: tuple[tuple[str, int], ...] = ()
    """M->N: where each trainer rank listens, in rank order (rank 0 is
    `trainer_address:trainer_port`)."""
    first_worker: int = 0
    """M->N: the index of this engine's worker 0 among every worker behind the trainer's
    client (`WeightSyncClient.init_each_engine`)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        ports = [self.trainer_port] + [port for _, port in self.trainers]
        if not all(1 <= port <= 65535 for port in ports) or not 0 <= self.session < 1 << 16:
            raise ConfigError("trainer_port (and each port of trainers) must be in 1..65535 "
                              "and session in 0..65535")
        if self.m2n and not self.trainers:
            raise ConfigError("an M->N init info (m2n=True) must list every trainer rank's "
                              "address in trainers")
        if self.first_worker < 0:
            raise ConfigError(f"first_worker must be >= 0, got {self.first_worker}")


@dataclass(frozen=True, kw_only=True)
class ReadsUpdate:
    """A whole update as one-sided reads out of the trainer's memory
    (`wtransfer_ucx.remote_reads`)."""

    keys: list[tuple[int, int, int, bytes]]
    """``[key, address, nbytes, packed remote key]`` of each registration the workers do not
    hold yet."""
    reads: bytes
    """Each tensor's address and key, packed signed 64-bit integers (key -1: empty tensor)."""
    drop: list[int]
    """Keys the trainer unregistered (their memory may not be read any more)."""

    def __post_init__(self) -> None:
        if len(self.reads) % 16:
            raise MetadataError("rma reads must be pairs of packed 64-bit integers")


@dataclass(frozen=True, kw_only=True)
class UCXUpdateInfo(UpdateInfo):
    """The update's tensor list (both sides derive the plan) and its sequence number."""

    tensors: list[Any] | None = None
    tensors_digest: str | None = None
    """Instead of `tensors`: `wtransfer.wire.digest` of the list this worker got last (a
    trainer sends the same list every step; the list itself is about 40 KB for 400 tensors)."""
    update: int = 0
    rma: ReadsUpdate | None = None
    """The whole update as one-sided reads out of the trainer's memory (see
    `wtransfer_ucx.remote_reads`); None: tagged buckets follow."""
    rma_ranks: list[ReadsUpdate] | None = None
    """M->N by one-sided reads (`wtransfer_ucx.m2n_reads`): each trainer rank's table of its
    registered shards, in rank order; None: tagged pair buckets follow."""
    plan_digest: str | None = None
    """M->N: `TransferPlan.digest` of the trainer's plan; a worker that planned otherwise
    refuses the update before any byte moves."""
    delta_buckets: list[int] | None = None
    """M->N delta (`wtransfer.delta.pieces`): what each bucket of the plan is, by its place in
    it (0 unchanged, -1 whole, else its encoded length); None: every bucket travels whole."""
