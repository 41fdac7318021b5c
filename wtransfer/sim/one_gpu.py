"""The one-GPU paths: trainer and engine processes sharing one GPU, buckets handed over
through CUDA IPC (`wtransfer plan --one-gpu PATH`).

Every rank's memory traffic goes through the one GPU's memory (one memory domain), and a
bucket is read where it was staged: no link moves it, so its "send" is the update call that
hands it over (`handover_s`, one at a time: the engine takes its calls in order). Paths:

* ``zero-copy``: the engine copies every tensor straight out of the trainer's storage (one
  copy of the model), then checks it for NaN/inf;
* ``packed``: the trainer packs each bucket into CUDA staging, the engine copies it into its
  weights and checks it (the simulator's pack -> send -> apply pipeline, `num_buffers` slots);

(on both, and on ``host``, a tensor of `OneGpu.checked_from` bytes or more that lands whole is
checked inside its copy, `wtransfer.receiver.finite_copy`: the check reads only the rest);
* ``host``: a host-resident (pinned) trainer copies each bucket host-to-device into CUDA
  staging (the "send" is the H2D copy, at `h2d_bandwidth`), the engine applies it;
* ``m2n``: `senders` trainer ranks each pack their shards into their own staging, the engine's
  workers copy out what they keep (in all, one copy of the model, as ``packed``);
* ``m2n-in-place``: the engine's workers copy what they keep straight out of every rank's
  shards (`wtransfer_ipc.m2n_in_place`): one copy of the model in all, one update call, each
  piece checked for NaN/inf after its copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from wtransfer.errors import ConfigError
from wtransfer.packing import TensorMeta
from wtransfer.receiver.finite import CHECKED_COPY_MIN_BYTES
from wtransfer.sim.cluster import Cluster, Link
from wtransfer.sim.layouts import engine_layouts, fsdp_layouts
from wtransfer.sim.simulate import simulate
from wtransfer.transport.m2n import plan_transfers

ONE_GPU_PATHS = ("zero-copy", "packed", "host", "m2n", "m2n-in-place")


@dataclass(frozen=True)
class OneGpu:
    """The GPU's rates (bytes per second) and the fixed costs of one update."""

    memory_bandwidth: float
    """Read plus write: a copy of N bytes takes 2N over it."""
    h2d_bandwidth: float
    """Pinned host memory to the GPU."""
    check_bandwidth: float | None
    """What the NaN/inf check reads per second (None: no check)."""
    handover_s: float = 100e-6
    """One bucket's update call, trainer to engine worker."""
    control_s: float = 0.002
    """The update's start and finish round trips."""
    checked_from: int | None = CHECKED_COPY_MIN_BYTES
    """Tensors from this size that land whole are checked inside their copy (None: the check
    reads every byte after the copies, as without Triton)."""


def predict_one_gpu(path: str, metas: Sequence[TensorMeta], gpu: OneGpu, *,
                    bucket_bytes: int = 1 << 30, num_buffers: int = 4,
                    senders: int = 1) -> dict[str, float]:
    """Predicted seconds of one update of `metas` on `path` (`ONE_GPU_PATHS`), and what the
    floors of the same model take on `gpu` (one copy, one host-to-device copy)."""
    model = sum(m.nbytes for m in metas)
    floors = {"one_copy_s": 2 * model / gpu.memory_bandwidth,
              "one_h2d_s": model / gpu.h2d_bandwidth}
    if path not in ONE_GPU_PATHS:
        raise ConfigError(f"one-GPU path {path!r}: choose one of {list(ONE_GPU_PATHS)}")
    whole_up_to = model if path == "zero-copy" else 0 if path == "m2n" else bucket_bytes
    in_copy = [gpu.checked_from is not None and gpu.checked_from <= m.nbytes <= whole_up_to
               for m in metas]  # (M->N's pieces: none)
    if path in ("zero-copy", "m2n-in-place"):
        read_again = sum(m.nbytes for m, checked in zip(metas, in_copy, strict=True)
                         if not checked or path == "m2n-in-place")
        check = read_again / gpu.check_bandwidth if gpu.check_bandwidth else 0.0
        call = gpu.handover_s if path == "m2n-in-place" else 0.0  # (zero-copy: in control_s)
        return {"predicted_s": floors["one_copy_s"] + check + call + gpu.control_s, **floors}
    host = path == "host"
    link = (Link("pcie", gpu.h2d_bandwidth, gpu.handover_s) if host
            else Link("handover", 1e18, gpu.handover_s))
    ranks = senders if path == "m2n" else 1
    cluster = Cluster(gpus_per_node=ranks + 1, nic=link, nvlink=link, local=link,
                      memory_bandwidth=gpu.memory_bandwidth, senders=ranks, colocated=True,
                      shared_host=True)  # (every rank in one memory domain, one hand-over
    plan = plan_transfers(list(metas), fsdp_layouts(list(metas), ranks),  # at a time)
                          engine_layouts(list(metas), 1, 1, ep=False), bucket_bytes)
    prediction = simulate(plan, metas, cluster, num_buffers=num_buffers, pack=not host,
                          check_bandwidth=gpu.check_bandwidth, checked_in_copy=in_copy,
                          control_s=gpu.control_s)
    return {"predicted_s": prediction.seconds, **floors}
