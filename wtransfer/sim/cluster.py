"""Where the ranks of a plan sit and the links between them.

Trainer rank s sits on GPU s (node s // gpus_per_node); engine worker w on the nodes after the
trainer's (disaggregated), or on GPU w of the same nodes when `colocated` (a trainer and its
engine sharing GPUs). A (sender, worker) pair talks over:

* ``local``: the same GPU (an on-device copy, HBM),
* ``nvlink``: two GPUs of one node (or shared memory between processes on one host),
* ``nic``: two nodes, each GPU with its share of the node's NICs.

Each rank moves one bucket at a time (the transports do: one operation per rank per round), so
a link's bandwidth is the rank's own: a GPU's NVLink bandwidth one way, or its NIC share.

Memory traffic (packing, converting, applying) is bounded per GPU: a trainer rank and a worker
sharing a GPU (`colocated`) take turns on its memory. A `shared_host` cluster is one whose
ranks are processes of one CPU host (this VM): every pack, apply and message of a node shares
its memory bandwidth and its loopback link, one at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

from wtransfer.errors import ConfigError


@dataclass(frozen=True)
class Link:
    """One class of link: bandwidth (bytes per second, one way) and the fixed cost of one
    message on it (seconds)."""

    name: str
    bandwidth: float
    latency_s: float

    def __post_init__(self) -> None:
        if self.bandwidth <= 0 or self.latency_s < 0:
            raise ConfigError(f"link {self.name!r}: bandwidth must be > 0 and latency >= 0")

    def seconds(self, nbytes: int) -> float:
        """Time of one message of `nbytes`."""
        return self.latency_s + nbytes / self.bandwidth


@dataclass(frozen=True)
class Cluster:
    """The machines of a plan (see the module docstring)."""

    gpus_per_node: int
    nic: Link
    """One GPU's share of its node's NICs."""
    nvlink: Link
    local: Link
    memory_bandwidth: float
    """Bytes per second a GPU reads plus writes (packing, converting, applying)."""
    senders: int
    colocated: bool = False
    shared_host: bool = False

    @classmethod
    def of(cls, *, senders: int, gpus_per_node: int = 8, nics_per_node: int = 8,
           nic_gbit: float = 400, nic_efficiency: float = 0.93, nic_latency_us: float = 10,
           nvlink_gbps: float = 380, nvlink_latency_us: float = 5,
           hbm_gbps: float = 4800, colocated: bool = False) -> Cluster:
        """A cluster from datasheet numbers: NICs in Gbit/s at `nic_efficiency` of line rate
        (400 Gbit/s x 0.93 = 46.5 GB/s), NVLink and HBM in GB/s (H100/H200: about 380 GB/s one
        way per GPU; HBM 3.35 / 4.8 TB/s)."""
        if gpus_per_node < 1 or nics_per_node < 1 or senders < 1:
            raise ConfigError("gpus_per_node, nics_per_node and senders must be >= 1")
        share = nic_gbit / 8 * 1e9 * nic_efficiency * min(1.0, nics_per_node / gpus_per_node)
        return cls(gpus_per_node=gpus_per_node,
                   nic=Link("nic", share, nic_latency_us * 1e-6),
                   nvlink=Link("nvlink", nvlink_gbps * 1e9, nvlink_latency_us * 1e-6),
                   local=Link("local", hbm_gbps * 1e9 / 2, 2e-6),
                   memory_bandwidth=hbm_gbps * 1e9, senders=senders, colocated=colocated)

    def sender_gpu(self, sender: int) -> int:
        """Global GPU index of trainer rank `sender`."""
        return sender

    def worker_gpu(self, worker: int) -> int:
        """Global GPU index of engine worker `worker`."""
        if self.colocated:
            return worker
        first = -(-self.senders // self.gpus_per_node) * self.gpus_per_node
        return first + worker

    def memory_domain(self, gpu: int) -> int:
        """What a rank on `gpu` shares memory bandwidth with (its GPU, or its host)."""
        return gpu // self.gpus_per_node if self.shared_host else gpu

    def link_domain(self, sender: int, worker: int) -> int | None:
        """The node whose one link every message of the pair shares (shared hosts only)."""
        return self.sender_gpu(sender) // self.gpus_per_node if self.shared_host else None

    def link(self, sender: int, worker: int) -> Link:
        """The link between trainer rank `sender` and engine worker `worker`."""
        a, b = self.sender_gpu(sender), self.worker_gpu(worker)
        if a == b:
            return self.local
        if a // self.gpus_per_node == b // self.gpus_per_node:
            return self.nvlink
        return self.nic
