"""Benchmark: send_weights end to end against a floor and a naive path, measured in one run.

    python benchmarks/transfer.py --backend ipc --models qwen3-0.6b,qwen3-1.7b --bucket-mb 64,256
    python benchmarks/transfer.py --backend nccl --models qwen3-0.6b --bucket-mb 64,256
    python benchmarks/transfer.py --backend nccl --trainer-ranks 2 --engine-tp 2 --models demo
    python benchmarks/transfer.py --backend ipc --trainer-ranks 2 --engine-tp 2 --models demo
    python benchmarks/transfer.py --backend ipc --trainer-ranks 2 --engine-tp 2 --device cuda:0

The packed path is the real two-process transfer: trainer here, receiver in a child process,
RPC control plane. Per backend, the floor and the naive baseline are:

* ipc: floor = the same bytes copied twice by plain torch copies in one process (pack into one
  flat buffer, unpack out of it); naive = one tensor per message (one update call and one
  staging handoff per tensor, no packing). ``--device cuda`` keeps both sides on the GPU.
* nccl (gloo on CPU): floor = one plain broadcast of a buffer holding every byte, to a peer
  process; naive = one broadcast per tensor, the way many frameworks do it.
* ucx: floor = one raw UCXX tagged send of a buffer holding every byte, to a peer process that
  acknowledges it; no naive row. Its paths: the default (named after what UCX chose for this
  machine: one-sided reads or tagged buckets), tagged buckets of each ``--bucket-mb``, and
  with ``--ucx-reads`` reads asked for by name.
"""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from wtransfer_ipc.info import IPCTrainerInitInfo
from wtransfer_ipc.sender import IPCSender
from wtransfer_nccl import NCCLTrainerInitInfo

import wtransfer
from wtransfer.control.clients import FanoutClient
from wtransfer.control.rpc import RPCClient
from wtransfer.launch.models import build
from wtransfer.launch.processes import spawn_receiver
from wtransfer.packing import Bucket, BucketPacker, BucketPlan, Slice, byte_view
from wtransfer.shapes import build_module, model_metas
from wtransfer.trainer.engine import Outgoing, Share
from wtransfer.transport.window import CallChannel

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import median_seconds, paired, print_table, progress, write_json


class PerTensorIPCSender(IPCSender):
    """The naive baseline: every tensor is its own message through one staging slot (no
    packing, no pipelining), the host waiting for every copy."""

    def _outgoing(self, share: Share) -> Outgoing:
        plan = share.plan
        single = BucketPlan(plan.metas, plan.bucket_bytes, plan.align, tuple(
            Bucket(i, m.nbytes, (Slice(i, 0, 0, m.nbytes),)) for i, m in enumerate(plan.metas)))
        share = replace(share, plan=single, buckets=single.buckets,
                        packer=BucketPacker(single, self.source.tensors()))

        def stage(bucket: Bucket, slot: int) -> torch.Tensor:
            share.packer.pack(bucket, self._staging[slot])
            if self.device.type == "cuda":  # naive: the host waits for every copy
                torch.cuda.current_stream(self.device).synchronize()
            return self._staging[slot][: bucket.nbytes]

        def describe(bucket: Bucket, slot: int, _data: torch.Tensor,
                     checksum: int | None) -> dict[str, Any]:
            update: dict[str, Any] = {"buffer": slot, "nbytes": bucket.nbytes,
                                      "checksum": checksum,
                                      "slices": [bucket.slices[0].to_wire()]}
            if bucket.index == 0:
                update["tensors"] = share.manifest.wire
            return update

        return Outgoing(share, channel=CallChannel(slots=1, stage=stage, describe=describe))


SCRATCH_BYTES = 1 << 30
"""The floors' scratch buffers: large enough for copies at full speed, small beside a model."""


def _synced(device: str) -> Callable[[], None]:
    if device.startswith("cuda"):
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def flat_copy(nbytes: int, device: str) -> Callable[[], None]:
    """One copy of `nbytes` on `device` (every byte read once and written once), in chunks
    of `SCRATCH_BYTES` between two scratch buffers: the floor of a transfer that moves every
    byte once, without holding two more copies of the model."""
    size = max(1, min(nbytes, SCRATCH_BYTES))
    src = torch.ones(size, dtype=torch.uint8, device=device)
    dst = torch.zeros_like(src)
    sync = _synced(device)

    def once() -> None:
        for start in range(0, nbytes, size):
            n = min(size, nbytes - start)
            dst[:n].copy_(src[:n])
        sync()

    return once


def copy_floors(model: torch.nn.Module, device: str) -> dict[str, Callable[[], None]]:
    """The copy floors over the model's bytes, on its device: one copy (what a zero-copy
    update must do: every byte read once, written once; `flat_copy`), and two (each tensor
    packed into a scratch buffer, then copied back out of it into the tensor: what a packed
    update must do). The scratch is `SCRATCH_BYTES` (or the largest tensor), so the floors
    hold no extra copy of the model (an 8B trainer, its floors and a receiver fit an 80 GB
    card). Buffers are allocated and touched once here, so no run pays page faults."""
    tensors = [byte_view(t) for t in model.state_dict().values()]
    total = sum(t.numel() for t in tensors)
    size = max(min(SCRATCH_BYTES, total), max(t.numel() for t in tensors))
    scratch = torch.zeros(size, dtype=torch.uint8, device=device)
    groups: list[list[torch.Tensor]] = [[]]
    filled = 0
    for t in tensors:  # consecutive tensors, each group fitting the scratch
        if filled + t.numel() > size:
            groups.append([])
            filled = 0
        groups[-1].append(t)
        filled += t.numel()
    sync = _synced(device)

    def two_copies() -> None:
        for group in groups:
            offset = 0
            for t in group:
                scratch[offset : offset + t.numel()].copy_(t)
                offset += t.numel()
            offset = 0
            for t in group:  # the same bytes back: the model is left as it was
                t.copy_(scratch[offset : offset + t.numel()])
                offset += t.numel()
        sync()

    return {"floor (1 copy)": flat_copy(total, device),
            "floor (2 copies)": two_copies}


def broadcast_baselines(name: str, model: torch.nn.Module, repeats: int, device: str,
                        devices: list[str]) -> tuple[float, float]:
    """(floor, per-tensor) medians between the trainer and one peer per receiver device: one
    broadcast of a flat buffer holding every byte, and one broadcast per tensor (NCCL on CUDA
    devices, gloo on CPU), in the same run as the transfers."""
    world = 1 + len(devices)
    store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=120),
                          wait_for_workers=False)
    peers = [subprocess.Popen([sys.executable, str(Path(__file__).with_name("bcast_peer.py")),
                               "--model", name, "--port", str(store.port),
                               "--repeats", str(repeats), "--rank", str(rank),
                               "--world", str(world), "--device", d])
             for rank, d in enumerate(devices, start=1)]
    try:
        nccl = device.startswith("cuda")
        pg: Any = (dist.ProcessGroupNCCL(store, 0, world, dist.ProcessGroupNCCL.Options())
                   if nccl else
                   dist.ProcessGroupGloo(store, 0, world, timedelta(seconds=600)))
        tensors = [byte_view(t) for t in model.state_dict().values()]
        flat = torch.cat(tensors)
        one = torch.zeros(1, device=device)

        def rounds(group: list[torch.Tensor]) -> Callable[[], None]:
            def run() -> None:
                for t in group:
                    pg.broadcast([t], dist.BroadcastOptions()).wait()
                pg.allreduce([one]).wait()
                if nccl:
                    torch.cuda.synchronize()
            return run

        floor = median_seconds(rounds([flat]), repeats)
        naive = median_seconds(rounds(tensors), repeats)
    finally:
        for peer in peers:
            peer.wait(timeout=600)
    return floor, naive


def ucx_floor(total: int, repeats: int, device: str, peer_device: str) -> float:
    """Median seconds of one raw UCXX send of `total` bytes from `device` to a peer process
    holding its buffer on `peer_device`, acknowledged by the peer."""
    from wtransfer_ucx.transport import UCXWorker, tag

    ucx = UCXWorker()
    port = ucx.listen(0)
    peer = subprocess.Popen([sys.executable, str(Path(__file__).with_name("ucx_peer.py")),
                             "--port", str(port), "--nbytes", str(total),
                             "--repeats", str(repeats), "--device", peer_device])
    try:
        (ep,) = ucx.wait_for_endpoints(1, 120)
        flat = torch.ones(total, dtype=torch.uint8, device=device)
        ack = torch.empty(8, dtype=torch.uint8)
        rounds = iter(range(repeats + 1))

        def one() -> None:
            i = next(rounds)
            ucx.wait([ucx.send(ep, flat, tag(0, 0, i)), ucx.recv(ack, (1 << 40) + i)], 600)

        floor = median_seconds(one, repeats)
        peer.wait(timeout=120)
    finally:
        ucx.close()
    return floor


@contextlib.contextmanager
def receivers(backend: str, name: str, devices: list[str], rollback: bool = False
              ) -> Iterator[Any]:
    """One receiver process per device (`--receiver-devices`); yields their client."""
    with contextlib.ExitStack() as stack:
        children = [stack.enter_context(spawn_receiver(backend, model=name, seed=2, device=d,
                                                       fill="constant", rollback=rollback))
                    for d in devices]
        clients = [RPCClient(c.address, timeout_s=600) for c in children]
        yield clients[0] if len(clients) == 1 else FanoutClient(clients)


def rollback_rows(backend: str, name: str, model: torch.nn.Module, buckets_mb: list[int],
                  devices: list[str], repeats: int) -> list[dict[str, Any]]:
    """The packed path into receivers that keep a host copy of every tensor they overwrite
    (`rollback=True`): what failing closed costs per update."""
    rows = []
    with receivers(backend, name, devices, rollback=True) as client:
        for mb in buckets_mb:
            info = trainer_info(backend, len(devices), bucket_bytes=mb << 20)
            with wtransfer.trainer_init(info, client=client,
                                        source=wtransfer.ModuleSource(model)) as sender:
                seconds = median_seconds(sender.send_weights, repeats)
            rows.append({"model": name, "path": "packed+rollback", "bucket_mb": mb,
                         "seconds": seconds})
    return rows


def bench_model(backend: str, name: str, buckets: list[tuple[int, int | None]], device: str,
                devices: list[str], repeats: int, rollback: bool = False,
                direct_mb: float | None = None, reads: bool = False) -> list[dict[str, Any]]:
    """Every path of `backend` for model `name`, each against its floor from the same run
    (`buckets`: (MiB, staging buffers) of each packed path; ucx: its default path, which UCX
    may make one-sided reads, and reads asked for by name only with `reads`)."""
    metas = model_metas(name)
    total = sum(m.nbytes for m in metas)
    model = build(name, seed=1, device=device, fill="constant")
    rows: list[dict[str, Any]] = []
    naive_s = float("nan")
    floors = copy_floors(model, device) if backend == "ipc" else {}
    fixed: dict[str, float] = {}
    if backend == "ucx":
        fixed["floor (1 raw UCX send)"] = ucx_floor(total, repeats, device, devices[0])
    elif backend == "nccl":
        fixed["floor (1 broadcast)"], naive_s = broadcast_baselines(name, model, repeats,
                                                                    device, devices)
    for path, seconds in fixed.items():
        rows.append({"model": name, "path": path, "bucket_mb": 0, "seconds": seconds,
                     "floor_s": seconds})
    paths: list[tuple[str, int, Any]] = []
    if backend == "ipc" and device.startswith("cuda"):
        paths.append(("zero-copy", 0, trainer_info(backend, len(devices))))
    if backend == "ucx":  # the default: UCX chooses reads or tagged buckets (the path's
        paths.append(("default", 0, trainer_info(backend, len(devices))))  # name says which)
    if backend == "ucx" and reads:  # each worker reads every tensor out of the trainer
        paths.append(("one-sided reads", 0, trainer_info(backend, len(devices), rma=True)))
    for mb, num_buffers in buckets:
        extra: dict[str, Any] = ({"zero_copy": False} if backend == "ipc" else
                                 {"rma": False} if backend == "ucx" else {})
        if direct_mb is not None and backend != "ipc":
            extra["direct_threshold"] = int(direct_mb * (1 << 20))
        # nccl and ucx may move tensors on their own (direct) besides packed buckets
        label = "packed" if backend == "ipc" else "send_weights"
        paths.append((label, mb, trainer_info(backend, len(devices),
                                               bucket_bytes=(mb << 20) or None,
                                               num_buffers=num_buffers, **extra)))
    with receivers(backend, name, devices) as client:
        for path, mb, info in paths:
            with wtransfer.trainer_init(info, client=client,
                                        source=wtransfer.ModuleSource(model)) as sender:
                if path == "default":
                    choice = cast(Any, sender).reads  # (a UCXSender's: why it chose)
                    path = f"default ({'reads' if choice.on else 'tagged'})"
                    print(f"ucx default: {choice}", flush=True)
                if floors:  # interleaved with its floor: the same machine state for both
                    floor_name = "floor (1 copy)" if path == "zero-copy" else "floor (2 copies)"
                    seconds, floor_s = paired(sender.send_weights, floors[floor_name], repeats)
                    rows.append({"model": name, "path": floor_name, "bucket_mb": mb,
                                 "seconds": floor_s, "floor_s": floor_s})
                else:
                    seconds = median_seconds(sender.send_weights, repeats)
                    floor_s = next(iter(fixed.values()))
            rows.append({"model": name, "path": path, "bucket_mb": mb, "seconds": seconds,
                         "floor_s": floor_s, "buffers": sender.num_buffers})
        if backend == "ipc":
            biggest = max(m.nbytes for m in metas)
            info = IPCTrainerInitInfo(bucket_bytes=-(-biggest // 256) * 256, num_buffers=1,
                                      timeout_s=600, zero_copy=False)
            with PerTensorIPCSender.trainer_init(info, client=client,
                                                 source=wtransfer.ModuleSource(model)) as naive:
                naive_s, floor_s = paired(naive.send_weights, floors["floor (2 copies)"],
                                          repeats)
        if backend != "ucx":
            rows.append({"model": name, "path": "naive per-tensor", "bucket_mb": 0,
                         "seconds": naive_s,
                         "floor_s": floor_s if backend == "ipc" else fixed["floor (1 broadcast)"]})
        same = client.fingerprint() == wtransfer.fingerprint(model.state_dict())
    if rollback:
        for row in rollback_rows(backend, name, model, [mb for mb, _ in buckets], devices,
                                 repeats):
            rows.append({**row, "floor_s": float("nan")})
    for r in rows:
        r.setdefault("buffers", "-")
        r.update(bytes=total, tensors=len(metas), gbps=total / r["seconds"] / 1e9,
                 vs_floor=r["floor_s"] / r["seconds"], vs_naive=naive_s / r["seconds"],
                 verified=same)
    return rows


def bench_sharded(backend: str, name: str, buckets_mb: list[int], ranks: int, senders: int,
                  repeats: int, device: str = "cpu") -> list[dict[str, Any]]:
    """FSDP2 trainer ranks (gloo, CPU) sending the same model with one sender, then with
    `senders`: median seconds of an update (the lead's own measure, start to finish). On a
    GPU (`device`) the ranks are processes on it holding the whole model (replicas), the
    receiver is on it too, and every rank sending goes M->N (each stages its share); the
    floor is one device copy of every byte, timed in this process."""
    from statistics import median

    from wtransfer.launch.trainer_ranks import TrainerRanks

    metas = model_metas(name)
    total = sum(m.nbytes for m in metas)
    floor_s = float("nan")
    if device != "cpu":
        floor_s = median_seconds(copy_floors(build_module(metas, 1, device, fill="constant"),
                                             device)["floor (1 copy)"], 5)
        torch.cuda.empty_cache()  # (the floor's model and scratch)
    rows = []
    with spawn_receiver(backend, model=name, seed=2, fill="constant", device=device) as child:
        for mb in buckets_mb:
            one = None
            for k in sorted({1, senders}):
                fields: dict[str, Any] = {"bucket_bytes": mb << 20, "timeout_s": 600}
                if backend == "nccl":
                    fields.update(master_address="127.0.0.1", world_size=k + 1)
                if device != "cpu":
                    fields.update(m2n=k == ranks, device=device)
                with TrainerRanks(ranks, backend=backend, addresses=[child.address],
                                  senders=k, model=name, updates=repeats + 1,
                                  init_fields=fields, timeout_s=600,
                                  device=device) as trainers:
                    trainers.wait_for(0, "sent", 3600, count=repeats + 1)
                    if trainers.wait(600) != [0] * ranks:
                        sys.exit(f"trainer ranks failed: {trainers.stderr(0)[-2000:]}")
                    sent = trainers.reports(0, "sent")[1:]
                seconds = median(r["seconds"] for r in sent)
                one = seconds if k == 1 else one
                rows.append({"model": name, "ranks": ranks, "senders": k, "bucket_mb": mb,
                             "seconds": seconds, "gbps": total / seconds / 1e9,
                             "vs_one": (one or seconds) / seconds,
                             "vs_floor": seconds / floor_s,
                             "peak_mb": max(r["gathered_peak_bytes"] for r in sent) / 2**20})
    return rows


def one_copy_seconds(nbytes: int, device: str, repeats: int) -> float:
    """Median time of one copy of `nbytes` on `device` (`flat_copy`)."""
    try:
        return median_seconds(flat_copy(nbytes, device), repeats)
    finally:
        if device.startswith("cuda"):
            torch.cuda.empty_cache()


def bench_m2n(backend: str, name: str, buckets_mb: list[int], ranks: int, tp: int,
              repeats: int, delta_fraction: float = 0.0, device: str = "cpu",
              reads: bool = False, staging: str = "off", rollback: str = "auto",
              only: set[str] | None = None) -> list[dict[str, Any]]:
    """FSDP2 trainer ranks (gloo, CPU) into our engine with `tp` workers (`wtransfer serve`),
    over nccl (gloo), ucx or ipc (shared memory): today's path (each bucket gathered to one
    sender, sent whole to every worker, which keeps its part) against M->N (nccl: every rank
    sends each worker only what it keeps, from its own shards; ipc: every rank stages its
    own shards, and each worker copies only what it keeps), on the same engine in one run.
    Bytes each worker received are the engine's own count (`/weight_info` workers'
    `last_update_bytes`). With `delta_fraction` (nccl, ucx) every rank flips a bit of that
    fraction of its elements between updates, and a third path sends M->N deltas (each rank
    diffs its own pair buckets): its wire bytes are what moved. With `reads` (ucx) a path
    where each worker reads its pair buckets out of every rank's shards (rma=True).
    `staging` and `rollback` are the engine's `--update-staging` and `--update-rollback`
    (rollback on copies every changed tensor's old value to host memory during the update).

    On a GPU (`device` cuda:N, ipc) every trainer rank and every engine worker share that
    GPU: the ranks hold the whole model as replicas (one process group cannot shard over one
    GPU with NCCL), so the first path is one rank staging everything (nothing to gather),
    and M->N has each worker copy its part straight out of the rank sending each tensor
    (read in place; "M->N staged": each rank stages half of it, `zero_copy=False`); all are
    timed against one flat copy of the model's bytes on the GPU, measured in the same run."""
    from statistics import median

    from wtransfer.demos.rl.servers import HTTPPolicyServer
    from wtransfer.launch.trainer_ranks import TrainerRanks

    rows = []
    progress(f"starting the engine ({name}, TP={tp}, {device}, update staging {staging}, "
             f"rollback {rollback})")
    server = HTTPPolicyServer(model=name, seed=2, backend=backend, tensor_parallel_size=tp,
                              update_staging=staging, update_rollback=rollback,
                              start_timeout_s=600, device=device)
    info = server.weight_info()
    progress(f"engine started: update staging {info['update_staging']}, rollback "
             f"{info.get('rollback')}")
    first = "gather+broadcast" if device == "cpu" else "one sender"
    try:
        for mb in buckets_mb:
            paths = [(first, 1, False, False), ("M->N", ranks, True, False)]
            if delta_fraction:
                paths.append(("M->N delta", ranks, True, True))
            if reads:
                paths.append(("M->N reads", ranks, True, False))
            if backend == "ipc" and device != "cpu":  # (M->N above reads the ranks in place)
                paths.append(("M->N staged", ranks, True, False))
            if only:
                paths = [p for p in paths if p[0] in only]
            for path, senders, m2n, delta in paths:
                progress(f"{path}, {mb} MiB buckets: {ranks} trainer ranks start")
                fields = {"bucket_bytes": mb << 20, "timeout_s": 600, "m2n": m2n, "delta": delta,
                          **({"master_address": "127.0.0.1"} if backend == "nccl" else {}),
                          **({"rma": True} if path == "M->N reads" else {}),
                          **({"zero_copy": False} if path == "M->N staged" else {})}
                with TrainerRanks(ranks, backend=backend, addresses=[server.url],
                                  senders=senders, model=f"llm:{name}", updates=repeats + 1,
                                  init_fields=fields, timeout_s=600, device=device,
                                  change_fraction=delta_fraction) as trainers:
                    trainers.wait_for(0, "sent", 3600, count=repeats + 1)
                    if trainers.wait(600) != [0] * ranks:
                        sys.exit(f"trainer ranks failed: {trainers.stderr(0)[-2000:]}")
                    sent = [trainers.reports(r, "sent")[1:] for r in range(ranks)]
                workers = sorted(server.weight_info()["workers"], key=lambda w: w["worker"])
                seconds = median(r["seconds"] for r in sent[0])
                total = sent[0][0]["bytes"]
                rows.append({"model": name, "path": path, "ranks": ranks, "tp": tp,
                             "bucket_mb": mb, "seconds": seconds, "gbps": total / seconds / 1e9,
                             "model_mb": total / 1e6,
                             "worker_mb": "/".join(f"{w['last_update_bytes'] / 1e6:.1f}"
                                                   for w in workers),
                             "kept_mb": "/".join(f"{w['kept_bytes'] / 1e6:.1f}" for w in workers),
                             "sent_mb": "/".join(f"{(r[-1].get('sent_bytes') or 0) / 1e6:.1f}"
                                                 for r in sent) if m2n else "-",
                             "peak_mb": max(r["gathered_peak_bytes"] for rs in sent for r in rs)
                             / 2**20,
                             "wire_mb": "/".join(f"{median(s['wire_bytes'] for s in r) / 1e6:.1f}"
                                                 for r in sent) if delta else "-"})
                progress(f"{path}: median {seconds:.4f} s, workers received "
                         f"{rows[-1]['worker_mb']} MB")
            gather_s = rows[-len(paths)]["seconds"]
            if device != "cpu":
                floor_s = one_copy_seconds(round(rows[-1]["model_mb"] * 1e6), device, repeats)
            for row in rows[-len(paths):]:
                row["vs_gather"] = gather_s / row["seconds"]
                if device != "cpu":
                    row["copy_s"], row["x_copy"] = floor_s, row["seconds"] / floor_s
    finally:
        server.close()
    return rows


def trainer_info(backend: str, workers: int = 1, **fields: Any) -> Any:
    if backend == "ucx":
        from wtransfer_ucx import UCXTrainerInitInfo

        return UCXTrainerInitInfo(timeout_s=600, **fields)
    if backend == "nccl":
        return NCCLTrainerInitInfo(master_address="127.0.0.1",
                                   world_size=1 + workers, timeout_s=600, **fields)
    return IPCTrainerInitInfo(timeout_s=600, **fields)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="ipc", choices=["ipc", "nccl", "ucx"])
    parser.add_argument("--models", default="qwen3-0.6b,qwen3-1.7b")
    parser.add_argument("--bucket-mb", default="64,256",
                        help="bucket sizes in MiB, comma-separated; 0: the backend's default; "
                             "MiBxN: with N staging buffers (else --num-buffers)")
    parser.add_argument("--device", default="cpu", help="the trainer's device")
    parser.add_argument("--receiver-devices", default=None,
                        help="one receiver process per device, comma-separated (default: "
                             "--device); e.g. cuda:1,cuda:2,cuda:3 for nccl across GPUs")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--num-buffers", type=int, default=None,
                        help="staging buffers per side for the packed paths (default: the "
                             "backend's choice)")
    parser.add_argument("--direct-mb", type=float, default=None,
                        help="nccl/ucx: tensors of at least this many MiB move on their own, "
                             "straight into the parameter (0: pack everything); default: the "
                             "backend's choice")
    parser.add_argument("--ucx-reads", action="store_true",
                        help="ucx: also measure one-sided reads out of the trainer's memory "
                             "(rma=True; with --engine-tp, out of every rank's shards)")
    parser.add_argument("--rollback", action="store_true",
                        help="also measure the packed path into a receiver with rollback on")
    parser.add_argument("--trainer-ranks", type=int, default=0,
                        help="FSDP2 trainer ranks (gloo) sending together instead of one "
                             "process: one sender versus --senders")
    parser.add_argument("--senders", type=int, default=2)
    parser.add_argument("--engine-tp", type=int, default=0,
                        help="with --trainer-ranks (nccl, ucx, ipc; ipc also on --device "
                             "cuda:N, every process on that GPU): into our engine with this "
                             "many tensor-parallel workers, gather+broadcast versus M->N")
    parser.add_argument("--delta-fraction", type=float, default=0.0,
                        help="with --engine-tp (nccl, ucx): between updates each rank flips a "
                             "bit of this fraction of its elements, and M->N deltas are a "
                             "third path")
    parser.add_argument("--paths", default=None,
                        help="with --engine-tp: only these paths, comma-separated (e.g. "
                             "'one sender,M->N')")
    parser.add_argument("--update-staging", default="off",
                        choices=["auto", "off", "swap", "copy"],
                        help="with --engine-tp: the engine's --update-staging")
    parser.add_argument("--update-rollback", default="auto", choices=["auto", "on", "off"],
                        help="with --engine-tp: the engine's --update-rollback (auto: on "
                             "where the model fits in half the host's memory)")
    args = parser.parse_args()
    if args.trainer_ranks and args.engine_tp:
        m2n_rows: list[dict] = []
        for name in args.models.split(","):
            m2n_rows += bench_m2n(args.backend, name, [int(x) for x in args.bucket_mb.split(",")],
                                  args.trainer_ranks, args.engine_tp, args.repeats,
                                  args.delta_fraction, args.device, args.ucx_reads,
                                  args.update_staging, args.update_rollback,
                                  set(args.paths.split(",")) if args.paths else None)
        print(f"\n{args.backend} trainer ranks={args.trainer_ranks} (FSDP2) -> engine "
              f"TP={args.engine_tp} on {args.device} (update staging {args.update_staging}, "
              f"rollback {args.update_rollback}), repeats={args.repeats} (median seconds; "
              "vs gather = the first path's time / this; x 1 copy = this / one flat copy of "
              "the model's bytes on the GPU; MB per worker as the engine counted them)")
        on_gpu = [("copy_s", "1 copy s", ".4f"), ("x_copy", "x 1 copy", ".2f")
                  ] if args.device != "cpu" else []
        print_table(m2n_rows, [("model", "model", ""), ("path", "path", ""),
                               ("bucket_mb", "MiB", "d"), ("seconds", "median s", ".3f"),
                               ("gbps", "GB/s", ".2f"), ("vs_gather", "vs gather", ".2f"),
                               *on_gpu, ("model_mb", "model MB", ".1f"),
                               ("worker_mb", "received MB/worker", ""),
                               ("kept_mb", "kept MB/worker", ""),
                               ("sent_mb", "sent MB/rank", ""),
                               ("peak_mb", "gathered peak MiB", ".1f"),
                               ("wire_mb", "delta wire MB/rank", "")])
        path = write_json(f"transfer-m2n-{args.backend}-ranks{args.trainer_ranks}"
                          f"-tp{args.engine_tp}", m2n_rows, vars(args))
        print(f"wrote {path}")
        return
    if args.trainer_ranks:
        sharded_rows: list[dict] = []
        for name in args.models.split(","):
            sharded_rows += bench_sharded(args.backend, name,
                                          [int(x) for x in args.bucket_mb.split(",")],
                                          args.trainer_ranks, args.senders, args.repeats,
                                          args.device)
        print(f"\nbackend={args.backend} trainer ranks={args.trainer_ranks} (FSDP2, gloo) "
              f"repeats={args.repeats} (median seconds; vs one = one sender's time / this)")
        print_table(sharded_rows, [("model", "model", ""), ("ranks", "ranks", "d"),
                                   ("senders", "senders", "d"), ("bucket_mb", "MiB", "d"),
                                   ("seconds", "median s", ".3f"), ("gbps", "GB/s", ".2f"),
                                   ("vs_one", "vs one", ".2f"),
                                   ("vs_floor", "/ 1 copy", ".2f"),
                                   ("peak_mb", "gathered peak MiB", ".1f")])
        path = write_json(f"transfer-{args.backend}-ranks{args.trainer_ranks}", sharded_rows,
                          vars(args))
        print(f"wrote {path}")
        return
    rows: list[dict] = []
    for name in args.models.split(","):
        rows += bench_model(args.backend, name, [
            (int(mb), int(n) if n else args.num_buffers) for mb, _, n in
            (x.partition("x") for x in args.bucket_mb.split(","))],
                            args.device, (args.receiver_devices or args.device).split(","),
                            args.repeats, args.rollback, args.direct_mb, args.ucx_reads)
    print(f"\nbackend={args.backend} device={args.device} repeats={args.repeats} "
          f"(median seconds; ratios: floor/time and naive/time, higher is better)")
    print_table(rows, [("model", "model", ""), ("path", "path", ""), ("bucket_mb", "MiB", "d"),
                       ("buffers", "buffers", ""), ("seconds", "median s", ".3f"),
                       ("gbps", "GB/s", ".2f"),
                       ("vs_floor", "vs floor", ".2f"), ("vs_naive", "vs naive", ".2f"),
                       ("verified", "bit-exact", "")])
    path = write_json(f"transfer-{args.backend}-{args.device.split(':')[0]}", rows, vars(args))
    print(f"wrote {path}")
    if not all(r["verified"] for r in rows):
        sys.exit("fingerprint mismatch after the benchmark")


if __name__ == "__main__":
    main()
