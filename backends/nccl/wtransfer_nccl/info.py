"""The NCCL backend's init and update records."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from wtransfer.errors import ConfigError
from wtransfer.records import Capabilities, ReceiverInitInfo, TrainerInitInfo, UpdateInfo

LIFELINE_CHECK_S = 0.2
"""How often an open update looks at its lifeline (between calls, and while a broadcast is
awaited: NCCL never notices a dead rank on its own)."""
CAPABILITIES = Capabilities(pair_deltas=True, calls_read_sender_memory=False,
                            sender_check_s=LIFELINE_CHECK_S)
"""What nccl can do: M->N pair buckets as messages of their own; the group paces the
sender; the receiver watches its lifeline."""

TRANSPORTS = ("nccl", "gloo")


def _check_endpoint(address: str, port: int, world_size: int | None, *,
                    lowest_port: int) -> None:
    if not address:
        raise ConfigError("master_address must name the trainer's host (e.g. '127.0.0.1')")
    if not lowest_port <= port <= 65535:
        raise ConfigError(f"master_port must be in {lowest_port}..65535, got {port}")
    if world_size is not None and world_size < 2:
        raise ConfigError(f"world_size counts the trainer and every worker, so it must be >= 2, "
                          f"got {world_size}")


@dataclass(frozen=True, kw_only=True)
class NCCLTrainerInitInfo(TrainerInitInfo):
    """Trainer side: the sending trainer ranks are ranks 0..K-1 (one, unless several trainer
    ranks send) of a `world_size` rendezvous the first sender hosts at
    `master_address:master_port`; engine workers are ranks K..world_size-1, numbered in the
    order of the client's engines (`WeightSyncClient.init_each_engine`). Each sender
    broadcasts its share of the buckets in a group of its own with every worker, or, in an
    M->N transfer (`m2n`), every trainer rank sends each worker the parts of its own shards
    that worker keeps, over one group of them all."""

    backend: ClassVar[str] = "nccl"
    master_address: str
    world_size: int | None = None
    """The sending trainer ranks plus every receiving worker behind the client; None
    (default): that sum, counted at init (`client.num_workers()`)."""
    m2n: bool | None = None
    """Send each worker only what it keeps, from the trainer ranks that hold it, without
    gathering (`wtransfer.transport.m2n`): every trainer rank needs a client then. None
    (default): when the source is sharded and every trainer rank has a client, and for a lone
    sender of a whole model (1->N) when some worker keeps part of a tensor (a TP or EP engine;
    whole replicas, as data-parallel ranks, take the broadcast); False: gather each bucket to
    a sender and broadcast it to every worker."""
    master_port: int = 0
    """Port of the rendezvous the first sender hosts; 0 (default): a free one the OS picks,
    sent to the receivers in their init info. Name one where a firewall needs it."""
    device: str | None = None
    """Staging device; default the source's. CUDA uses NCCL, CPU uses gloo."""

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_endpoint(self.master_address, self.master_port, self.world_size, lowest_port=0)


@dataclass(frozen=True, kw_only=True)
class NCCLInitInfo(ReceiverInitInfo):
    """What each engine gets: where to rendezvous, and the rank of its first worker."""

    master_address: str
    master_port: int
    world_size: int
    rank_offset: int
    """Rank of this engine's worker 0; worker i of the engine is ``rank_offset + i``."""
    transport: str
    senders: int = 1
    """Sending trainer ranks (ranks 0..senders-1); each broadcasts its buckets
    (`BucketPlan.owners`) in its own group of itself and every worker."""
    batch: int = 1
    """Consecutive direct tensors the sender broadcasts in one NCCL group call; every rank
    must group alike, so the receiver takes the sender's number."""
    first_batch: int | None = None
    """At most this many in the first group call (None: `batch`), so the bytes start moving
    before either side prepared a whole batch; the sender's number, like `batch`."""
    m2n: bool = False
    """One group of every trainer rank and worker: each worker receives only what it keeps,
    from every trainer rank (`wtransfer.transport.m2n`), and publishes its layouts in the
    rendezvous at init."""
    m2n_by_layouts: bool = False
    """A lone sender decides between M->N and the broadcast from what the workers keep: each
    worker publishes its layouts, then joins the group the lead's decision names
    (`wtransfer_nccl.m2n.read_decision`)."""
    lifeline_port: int | None = None
    """Port of the lead trainer's `wtransfer.transport.tcp_lifeline.LifelineListener` at
    `master_address`: each worker connects once, and fails an open update within moments of
    that trainer's death instead of after `timeout_s` (NCCL itself waits forever for a dead
    rank). A worker that cannot connect within 5 s (a firewall) goes on without it. None: a
    trainer that offers none."""

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_endpoint(self.master_address, self.master_port, self.world_size, lowest_port=1)
        if self.lifeline_port is not None and not 1 <= self.lifeline_port <= 65535:
            raise ConfigError(f"lifeline_port must be in 1..65535, got {self.lifeline_port}")
        if not 1 <= self.batch <= 1024:
            raise ConfigError(f"batch must be in 1..1024, got {self.batch}")
        if self.first_batch is not None and not 1 <= self.first_batch <= self.batch:
            raise ConfigError(f"first_batch must be in 1..batch ({self.batch}), "
                              f"got {self.first_batch}")
        if not 1 <= self.senders < self.world_size:
            raise ConfigError(f"senders must be in 1..world_size-1, got {self.senders}")
        if not self.senders <= self.rank_offset < self.world_size:
            raise ConfigError(f"rank_offset must be in {self.senders}..world_size-1 "
                              f"({self.world_size - 1}), got {self.rank_offset}")
        if self.transport not in TRANSPORTS:
            raise ConfigError(f"transport must be one of {TRANSPORTS}, got {self.transport!r}")


@dataclass(frozen=True, kw_only=True)
class NCCLUpdateInfo(UpdateInfo):
    """The whole update's tensor list (or the digest of the one the receiver got last); both
    sides derive the bucket plan from it."""

    tensors: list[Any] | None = None
    tensors_digest: str | None = None
    """Instead of `tensors`: `wtransfer.wire.digest` of the list this receiver got in its last
    update under the same init. A trainer sends the same list every step; naming it spares
    sending, decoding and comparing hundreds of entries on every update."""
    plan_digest: str | None = None
    """M->N: `TransferPlan.digest` of the trainer's plan; a worker that planned otherwise
    refuses the update before any byte moves."""
    delta_buckets: list[int] | None = None
    """M->N delta (`wtransfer.delta.pieces`): what each bucket of the plan is, by its place in
    it (0 unchanged, -1 whole, else its encoded length); None: every bucket travels whole."""
