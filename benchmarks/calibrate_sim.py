"""Calibrate the simulator (`wtransfer plan`) on the runs this machine can make.

    python benchmarks/calibrate_sim.py [--model qwen3-0.6b] [--repeats 3]

1. Measure the machine: memory bandwidth (one large in-process copy, bytes read plus
   written) and the gloo link between two processes (bandwidth of 64 MB messages, latency of
   1 KB ping-pongs).
2. Run real updates of the engine's model: nccl (gloo) M->N from 1 trainer process into a
   whole receiver, and from 2 and 4 FSDP2 ranks into our engine with 2 tensor-parallel
   workers (rollback off, and on: a snapshot copy before each write); ipc (shared memory) from
   1 process into a whole receiver. Each configuration's
   fixed cost per update (its control round trips) is measured on the "tiny" model in the same
   configuration.
3. Predict each from the measured link speeds with the planner and simulator the scale table
   uses, and print predicted against measured (median of the updates after the first).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from wtransfer.inference.model.decoder import load_model
from wtransfer.inference.model.parallel import Parallel, layouts
from wtransfer.launch.processes import free_port, spawn_receiver
from wtransfer.launch.trainer_ranks import TrainerRanks
from wtransfer.packing import TensorMeta
from wtransfer.sim.cluster import Cluster, Link
from wtransfer.sim.layouts import fsdp_layouts, tp_layout
from wtransfer.sim.simulate import simulate
from wtransfer.transport.m2n import plan_transfers

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import print_table, write_json

BIG = 64 << 20
SMALL = 1 << 10


def memory_bandwidth() -> float:
    """Bytes read plus written per second by one large copy."""
    a, b = torch.ones(256 << 20, dtype=torch.uint8), torch.empty(256 << 20, dtype=torch.uint8)
    times = []
    for _ in range(5):
        start = time.perf_counter()
        b.copy_(a)
        times.append(time.perf_counter() - start)
    return 2 * a.numel() / statistics.median(times)


def _peer(port: int) -> None:
    """The other end of `gloo_link`: receive the big messages, echo the small ones."""
    store = dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=60))
    pg: Any = dist.ProcessGroupGloo(store, 1, 2, timedelta(seconds=60))
    big, small = torch.empty(BIG, dtype=torch.uint8), torch.empty(SMALL, dtype=torch.uint8)
    for _ in range(6):
        pg.recv([big], 0, 0).wait()
    for _ in range(200):
        pg.recv([small], 0, 1).wait()
        pg.send([small], 0, 1).wait()


def gloo_link() -> Link:
    """The gloo link between two processes of this machine."""
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, None, True, timedelta(seconds=60),
                          wait_for_workers=False)
    child = subprocess.Popen([sys.executable, __file__, "--peer", str(port)])
    pg: Any = dist.ProcessGroupGloo(store, 0, 2, timedelta(seconds=60))
    big, small = torch.ones(BIG, dtype=torch.uint8), torch.ones(SMALL, dtype=torch.uint8)
    pg.send([big], 1, 0).wait()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        pg.send([big], 1, 0).wait()
        times.append(time.perf_counter() - start)
    start = time.perf_counter()
    for _ in range(200):
        pg.send([small], 1, 1).wait()
        pg.recv([small], 1, 1).wait()
    latency = (time.perf_counter() - start) / 400
    child.wait(60)
    bandwidth = BIG / max(1e-9, statistics.median(times) - latency)
    return Link("gloo", bandwidth, latency)


def tensor_list(model: str) -> tuple[list[TensorMeta], list[dict[str, Any]]]:
    """The engine model's tensors (tied ones once, as a trainer sends them) and what each of
    2 tensor-parallel workers keeps."""
    module = load_model(model)
    state = module.state_dict()
    seen, unique = set(), {}
    for name, tensor in state.items():
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            unique[name] = tensor
    metas = [TensorMeta.of(n, t) for n, t in unique.items()]
    kept = [{n: lay for n, lay in layouts(module.config, Parallel(r, 2), state).items()
             if n in unique} for r in range(2)]
    return metas, kept


def measured(ranks: int, backend: str, address: str, model: str, repeats: int,
             fields: dict[str, Any]) -> float:
    """Median seconds of the updates after the first, as the lead rank measured them."""
    with TrainerRanks(ranks, backend=backend, addresses=[address], senders=ranks,
                      model=model, updates=repeats + 1, init_fields=fields,
                      timeout_s=600) as trainers:
        trainers.wait_for(0, "sent", 1800, count=repeats + 1)
        if trainers.wait(600) != [0] * ranks:
            sys.exit(f"trainer ranks failed: {trainers.stderr(0)[-2000:]}")
        return statistics.median(r["seconds"] for r in trainers.reports(0, "sent")[1:])


def run(model: str, repeats: int) -> list[dict[str, Any]]:
    """Measure, run, predict (see the module docstring)."""
    from wtransfer.demos.rl.servers import HTTPPolicyServer

    mem, gloo = memory_bandwidth(), gloo_link()
    print(f"memory {mem / 1e9:.2f} GB/s (read + write); gloo {gloo.bandwidth / 1e9:.2f} GB/s, "
          f"{gloo.latency_s * 1e6:.0f} us per message", flush=True)
    nccl = {"master_address": "127.0.0.1", "bucket_bytes": 64 << 20, "timeout_s": 600,
            "m2n": True}
    shm = Link("shm", 1e15, 0.0)  # a bucket handed over in shared memory: its call's cost
    metas, kept = tensor_list(model)
    rows = []
    cases: list[tuple[str, int, str, Link, int, bool]] = [
        ("nccl 1->1 (whole)", 1, "nccl", gloo, 1, False),
        ("nccl 2->2 (TP=2)", 2, "nccl", gloo, 2, False),
        ("nccl 4->2 (TP=2)", 4, "nccl", gloo, 2, False),
        ("nccl 2->2 (TP=2, rollback)", 2, "nccl", gloo, 2, True),
        ("ipc 1->1 (whole)", 1, "ipc", shm, 1, False)]
    for label, ranks, backend, link, tp, rollback in cases:
        fields = nccl if backend == "nccl" else {"bucket_bytes": 64 << 20, "timeout_s": 600,
                                                  "zero_copy": False}
        times = {}
        for name in ("tiny", model):
            if tp == 2:
                server = HTTPPolicyServer(model=name, seed=2, backend=backend,
                                          tensor_parallel_size=2, update_staging="off",
                                          update_rollback="on" if rollback else "off",
                                          start_timeout_s=600)
                try:
                    times[name] = measured(ranks, backend, server.url, f"llm:{name}", repeats,
                                           fields)
                finally:
                    server.close()
            else:
                with spawn_receiver(backend, model=f"llm:{name}", seed=2) as receiver:
                    times[name] = measured(ranks, backend, receiver.address, f"llm:{name}",
                                           repeats, fields)
        dests = kept if tp == 2 else [{m.name: tp_layout(m, 0, 1) for m in metas}]
        sources = (fsdp_layouts(metas, ranks) if ranks > 1
                   else [{m.name: tp_layout(m, 0, 1) for m in metas}])
        plan = plan_transfers(metas, sources, dests, 64 << 20)
        cluster = Cluster(gpus_per_node=64, nic=link, nvlink=link, local=link,
                          memory_bandwidth=mem, senders=ranks, colocated=True,
                          shared_host=True)  # every process on this one host
        predicted = simulate(plan, metas, cluster, control_s=times["tiny"],
                             rollback=rollback).seconds
        rows.append({"run": label, "model": model, "measured_s": times[model],
                     "control_s": times["tiny"], "predicted_s": predicted,
                     "error": predicted / times[model] - 1})
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-0.6b", help="an engine model name")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--peer", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.peer:
        _peer(args.peer)
        return
    rows = run(args.model, args.repeats)
    print("\nsimulator vs real runs on this machine (median s; error = predicted/measured - 1)")
    print_table(rows, [("run", "run", ""), ("model", "model", ""),
                       ("measured_s", "measured s", ".3f"), ("predicted_s", "predicted s", ".3f"),
                       ("error", "error", "+.0%"), ("control_s", "fixed s (tiny)", ".3f")])
    print(f"wrote {write_json('calibrate-sim', rows, vars(args))}")


if __name__ == "__main__":
    main()
