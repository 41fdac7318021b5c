"""Predict an update's time from the plan the transports run, and a rank-0 broadcast's.

The M->N plan (`wtransfer.transport.m2n.plan_transfers`) gives every pair bucket and its
round. Each bucket goes through three stages, and stages of different buckets overlap the way
the transports overlap them:

1. **pack** on its trainer rank: read its boxes out of the shards and write them to a staging
   slot (converting to the engine's dtype on the way: bf16 read, fp8 written), at the GPU's
   memory bandwidth (shared with whatever else uses that memory: `Cluster.memory_domain`);
   it needs one of the rank's `num_buffers` slots, free again once the bucket left;
2. **send** over the pair's link (`wtransfer.sim.cluster`): its latency plus bytes over
   bandwidth, once the rank's previous send and the worker's previous receive are done (each
   rank moves one bucket at a time, in round order) and the worker has a free slot;
3. **apply** on the worker: read the slot, write the weights, at memory bandwidth (with
   `rollback`, first a copy of what the write replaces, the receiver's rollback snapshot);
   the slot is free again after.

The update ends when the last bucket is applied, plus `control_s` (the start and finish
round trips). The baseline is what a transport without M->N does: rank 0 gathers every
bucket (its ingress link), converts it, and broadcasts it to every worker through its egress
link (a pipelined broadcast moves about the bytes once per link), bucket by bucket, the three
overlapped.
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

from wtransfer.packing import TensorMeta
from wtransfer.sim.cluster import Cluster, Link
from wtransfer.transport.m2n import TransferPlan


@dataclass
class Prediction:
    """What the simulator says about one plan on one cluster."""

    seconds: float
    """Predicted update time."""
    broadcast_seconds: float
    """The rank-0 gather + broadcast baseline on the same cluster."""
    total_bytes: int
    """Bytes the workers receive in all."""
    link_bytes: dict[str, int]
    """Bytes per link class."""
    busiest: str
    """The rank and direction whose link is busiest (bytes over bandwidth)."""
    busiest_seconds: float
    """That link's busy time: a bound no schedule beats."""
    max_messages_per_pair: int
    pairs: int
    buckets: int
    staging_peak_bytes: int
    """Most staging one rank holds (`num_buffers` x its largest bucket)."""
    dominated_by: str
    stage_seconds: dict[str, float] = field(default_factory=dict)
    """Busy time of the busiest rank in each stage (pack, send, apply)."""

    @property
    def link_share(self) -> float:
        """The busiest link's busy time over the predicted time (1.0: it never idles)."""
        return self.busiest_seconds / self.seconds if self.seconds else 0.0


def _pipeline(times: Sequence[tuple[float, float, float]]) -> float:
    """Three stages over buckets in order, each stage one at a time, overlapped."""
    end = [0.0, 0.0, 0.0]
    for stage_times in times:
        ready = 0.0
        for i, t in enumerate(stage_times):
            ready = max(ready, end[i]) + t
            end[i] = ready
    return end[2]


def simulate(plan: TransferPlan, metas: Sequence[TensorMeta], cluster: Cluster, *,
             num_buffers: int = 2, source_bytes_per_byte: Sequence[float] | None = None,
             control_s: float = 0.002, rollback: bool = False, pack: bool = True,
             check_bandwidth: float | None = None,
             checked_in_copy: Sequence[bool] | None = None) -> Prediction:
    """Predict `plan` on `cluster` (module docstring). `source_bytes_per_byte[i]`: trainer bytes
    read per byte sent of tensor i (default 1); `pack` False: the send fills the slot itself;
    `check_bandwidth`: the NaN/inf check's bytes/s, added to each apply (None: no check), but not
    for tensor i's bytes where `checked_in_copy[i]`."""
    ratio = list(source_bytes_per_byte) if source_bytes_per_byte is not None else None
    mem = cluster.memory_bandwidth
    pack_free: dict[int, float] = defaultdict(float)
    send_free: dict[int, float] = defaultdict(float)
    recv_free: dict[int, float] = defaultdict(float)
    apply_free: dict[int, float] = defaultdict(float)
    shared: dict[tuple[str, int], float] = defaultdict(float)
    """When each shared resource (a memory domain, a host's link) is next free."""
    sender_slots: dict[int, list[float]] = defaultdict(lambda: [0.0] * num_buffers)
    worker_slots: dict[int, list[float]] = defaultdict(lambda: [0.0] * num_buffers)
    busy: dict[tuple[str, int], float] = defaultdict(float)
    link_bytes: dict[str, int] = defaultdict(int)
    messages: dict[tuple[int, int], int] = defaultdict(int)
    largest: dict[tuple[str, int], int] = defaultdict(int)
    stage_busy: dict[str, dict[int, float]] = {k: defaultdict(float)
                                               for k in ("pack", "send", "apply")}
    finish = 0.0
    for bucket in plan.buckets:  # in round order
        s, w, nbytes = bucket.sender, bucket.worker, bucket.nbytes
        link = cluster.link(s, w)
        read = (sum(p.nbytes * ratio[p.tensor] for p in bucket.pieces) if ratio is not None
                else nbytes)
        pack_t = (read + nbytes) / mem if pack else 0.0
        send_t = link.seconds(nbytes)
        apply_t = (4 if rollback else 2) * nbytes / mem
        if check_bandwidth is not None:
            apply_t += sum(p.nbytes for p in bucket.pieces if checked_in_copy is None
                           or not checked_in_copy[p.tensor]) / check_bandwidth
        s_mem = ("mem", cluster.memory_domain(cluster.sender_gpu(s)))
        w_mem = ("mem", cluster.memory_domain(cluster.worker_gpu(w)))
        host = cluster.link_domain(s, w)
        slot = heapq.heappop(sender_slots[s])
        packed = max(pack_free[s], slot, shared[s_mem]) + pack_t
        pack_free[s] = shared[s_mem] = packed
        wslot = heapq.heappop(worker_slots[w])
        sent = max(packed, send_free[s], recv_free[w], wslot,
                   shared[("link", host)] if host is not None else 0.0) + send_t
        send_free[s] = recv_free[w] = sent
        if host is not None:
            shared[("link", host)] = sent
        heapq.heappush(sender_slots[s], sent)
        applied = max(sent, apply_free[w], shared[w_mem]) + apply_t
        apply_free[w] = shared[w_mem] = applied
        heapq.heappush(worker_slots[w], applied)
        finish = max(finish, applied)
        busy[("out", s)] += send_t
        busy[("in", w)] += send_t
        stage_busy["pack"][s] += pack_t
        stage_busy["send"][s] += send_t
        stage_busy["apply"][w] += apply_t
        link_bytes[link.name] += nbytes
        messages[(s, w)] += 1
        largest[("s", s)] = max(largest[("s", s)], nbytes)
        largest[("w", w)] = max(largest[("w", w)], nbytes)
    (direction, rank), busiest_s = max(busy.items(), key=lambda kv: kv[1],
                                       default=(("out", 0), 0.0))
    who = f"trainer rank {rank} out" if direction == "out" else f"worker {rank} in"
    seconds = finish + control_s
    stages = {k: max(v.values(), default=0.0) for k, v in stage_busy.items()}
    top = max(stages.items(), key=lambda kv: kv[1], default=("send", 0.0))
    dominated = (f"the busiest link ({who}, {busiest_s:.3f} s busy)"
                 if busiest_s >= 0.8 * finish else
                 f"{top[0]} on the busiest rank ({top[1]:.3f} s)" if top[1] >= 0.8 * finish
                 else "waiting between ranks (the schedule)")
    return Prediction(
        seconds=seconds,
        broadcast_seconds=broadcast_seconds(plan, metas, cluster, ratio=ratio,
                                            control_s=control_s),
        total_bytes=sum(link_bytes.values()), link_bytes=dict(link_bytes), busiest=who,
        busiest_seconds=busiest_s, max_messages_per_pair=max(messages.values(), default=0),
        pairs=len(messages), buckets=len(plan.buckets),
        staging_peak_bytes=num_buffers * max(largest.values(), default=0),
        dominated_by=dominated, stage_seconds=stages)


def broadcast_seconds(plan: TransferPlan, metas: Sequence[TensorMeta], cluster: Cluster, *,
                      ratio: Sequence[float] | None = None, bucket_bytes: int = 1 << 30,
                      control_s: float = 0.002) -> float:
    """The baseline: rank 0 gathers, converts and broadcasts every byte of the model to every
    worker, bucket by bucket (module docstring)."""
    model = sum(m.nbytes for m in metas)
    read = (sum(m.nbytes * ratio[i] for i, m in enumerate(metas)) if ratio is not None
            else model)
    gather_link = _slowest(cluster, [cluster.link(s, 0) for s in range(1, plan.senders)]
                           if plan.senders > 1 else [])
    gather_in = cluster.nvlink if gather_link is None else gather_link
    gathered = read * (plan.senders - 1) / max(plan.senders, 1)
    out = _slowest(cluster, [cluster.link(0, w) for w in range(plan.workers)]) or cluster.local
    count = max(1, -(-model // bucket_bytes))
    stages = (gather_in.seconds(int(gathered / count)) if plan.senders > 1 else 0.0,
              (read + model) / count / cluster.memory_bandwidth,
              out.seconds(model // count))
    return _pipeline([stages] * count) + 2 * model / count / cluster.memory_bandwidth + control_s


def _slowest(cluster: Cluster, links: Sequence[Link]) -> Link | None:
    return min(links, key=lambda link: link.bandwidth, default=None)
