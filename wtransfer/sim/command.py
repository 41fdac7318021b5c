"""`wtransfer plan`: plan a model's update for a cluster and print what the simulator
predicts (see `wtransfer.sim.scenario`)."""

from __future__ import annotations

import argparse
import json
import math

from wtransfer.errors import ConfigError
from wtransfer.sim.cluster import Cluster
from wtransfer.sim.one_gpu import ONE_GPU_PATHS, OneGpu, predict_one_gpu
from wtransfer.sim.scenario import Scenario, model_tensors, plan_cluster


def _count(text: str) -> int:
    """An argparse type: a whole number of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _rate(text: str) -> float:
    """An argparse type: a finite number above 0 (a bandwidth)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number above 0, got {text}")
    return value


def _buffers(text: str) -> int:
    """An argparse type: staging buffers per side, 1..16 (what the transports accept)."""
    value = _count(text)
    if value > 16:
        raise argparse.ArgumentTypeError(f"must be at most 16, got {value}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `wtransfer plan`."""
    parser.add_argument("--model", required=True,
                        help="kimi-k2, deepseek-v3, qwen3-235b-a22b or a Qwen3 dense list")
    parser.add_argument("--trainer", default="fsdp",
                        help="fsdp, or megatron:tp=T,pp=P,ep=E")
    parser.add_argument("--trainer-gpus", type=_count, required=True, help="trainer ranks")
    parser.add_argument("--engine", required=True,
                        help="REPLICAS x TP workers, e.g. 8x16; add 'ep' to split experts by "
                             "expert: 8x16ep")
    parser.add_argument("--engine-dtype", choices=["bf16", "fp8"], default="bf16",
                        help="what the engine holds (fp8: projection weights converted on "
                             "the trainer before sending)")
    parser.add_argument("--gpus-per-node", type=_count, default=8)
    parser.add_argument("--nics-per-node", type=_count, default=8)
    parser.add_argument("--nic-gbit", type=_rate, default=400, help="Gbit/s per NIC")
    parser.add_argument("--nvlink-gbps", type=_rate, default=380,
                        help="GB/s one way per GPU within a node")
    parser.add_argument("--hbm-gbps", type=_rate, default=4800, help="GPU memory GB/s")
    parser.add_argument("--colocated", action="store_true",
                        help="engine worker w on trainer GPU w (shared GPUs)")
    parser.add_argument("--bucket-mb", type=_count, default=1024)
    parser.add_argument("--num-buffers", type=_buffers, default=2)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--one-gpu", choices=ONE_GPU_PATHS, default=None,
                        help="predict a path with the trainer and engine on one GPU "
                             "(wtransfer.sim.one_gpu) instead of planning a cluster")
    parser.add_argument("--h2d-gbps", type=_rate, default=55,
                        help="with --one-gpu host: GB/s from pinned host memory to the GPU")
    parser.add_argument("--check-gbps", type=_rate, default=None,
                        help="with --one-gpu: GB/s the NaN/inf check reads (default: "
                             "--hbm-gbps)")
    parser.add_argument("--handover-us", type=_rate, default=100,
                        help="with --one-gpu: one bucket's update call, in microseconds")


def parse_engine(text: str) -> tuple[int, int, bool]:
    """``RxT`` or ``RxTep`` -> (replicas, tp, expert parallel)."""
    ep = text.endswith("ep")
    body = text[:-2] if ep else text
    try:
        replicas, tp = (int(x) for x in body.split("x"))
    except ValueError:
        raise ConfigError(f"--engine {text!r}: expected REPLICASxTP, e.g. 8x16 or 8x16ep") \
            from None
    if replicas < 1 or tp < 1:
        raise ConfigError(f"--engine {text!r}: replicas and tp must be >= 1")
    return replicas, tp, ep


def report(sc: Scenario) -> dict[str, object]:
    """The plain form of a scenario's plan and prediction."""
    p = sc.prediction
    return {"model": sc.model, "model_gb": sc.model_bytes / 1e9,
            "engine_copy_gb": sc.engine_bytes / 1e9, "moved_gb": p.total_bytes / 1e9,
            "predicted_s": p.seconds, "broadcast_s": p.broadcast_seconds,
            "busiest_link": p.busiest, "busiest_link_s": p.busiest_seconds,
            "busiest_link_share": p.link_share, "dominated_by": p.dominated_by,
            "link_gb": {k: v / 1e9 for k, v in p.link_bytes.items()},
            "pairs": p.pairs, "buckets": p.buckets,
            "max_messages_per_pair": p.max_messages_per_pair,
            "staging_peak_mb": p.staging_peak_bytes / 1e6, "rounds": sc.plan.rounds,
            "stage_s": p.stage_seconds, "plan_s": sc.plan_seconds, "digest": sc.plan.digest}


def cmd_plan(args: argparse.Namespace) -> int:
    """Plan and simulate (see the module docstring)."""
    replicas, tp, ep = parse_engine(args.engine)
    if args.one_gpu is not None:
        return _one_gpu(args, replicas)
    cluster = Cluster.of(senders=args.trainer_gpus, gpus_per_node=args.gpus_per_node,
                         nics_per_node=args.nics_per_node, nic_gbit=args.nic_gbit,
                         nvlink_gbps=args.nvlink_gbps, hbm_gbps=args.hbm_gbps,
                         colocated=args.colocated)
    sc = plan_cluster(args.model, trainer=args.trainer, trainer_gpus=args.trainer_gpus,
                      replicas=replicas, tp=tp, ep=ep, cluster=cluster,
                      engine_dtype=args.engine_dtype, bucket_bytes=args.bucket_mb << 20,
                      num_buffers=args.num_buffers)
    out = report(sc)
    return _emit(args, out, [
        f"{sc.model}: {out['model_gb']:.1f} GB trainer copy, {out['engine_copy_gb']:.1f} GB "
        f"per engine copy ({args.engine_dtype}); {args.trainer} over {args.trainer_gpus} "
        f"GPUs -> {replicas} x {tp}{' (experts split)' if ep else ''} workers",
        f"  moved {out['moved_gb']:.1f} GB in {sc.plan.buckets.__len__()} pair buckets over "
        f"{out['pairs']} pairs, {sc.plan.rounds} rounds (planned in {sc.plan_seconds:.1f} s)",
        f"  predicted {sc.prediction.seconds:.3f} s (rank-0 broadcast: "
        f"{sc.prediction.broadcast_seconds:.2f} s)",
        f"  busiest link: {out['busiest_link']}, busy {sc.prediction.busiest_seconds:.3f} s "
        f"({sc.prediction.link_share:.0%} of the update); dominated by "
        f"{sc.prediction.dominated_by}",
        f"  staging peak per rank {out['staging_peak_mb']:.0f} MB; at most "
        f"{out['max_messages_per_pair']} messages per pair; bytes per link class: "
        + ", ".join(f"{k} {v:.1f} GB" for k, v in out["link_gb"].items())])  # type: ignore[attr-defined]


def _emit(args: argparse.Namespace, out: dict[str, object], lines: list[str]) -> int:
    """Print `out` as one JSON object with --json, else `lines`."""
    print(json.dumps(out) if args.json else "\n".join(lines))
    return 0


def _one_gpu(args: argparse.Namespace, replicas: int) -> int:
    """`--one-gpu PATH`: predict a one-GPU path (`wtransfer.sim.one_gpu`) and print it."""
    m2n = args.one_gpu.startswith("m2n")
    if replicas != 1 or (not m2n and args.trainer_gpus != 1):
        raise ConfigError(f"--one-gpu {args.one_gpu}: one engine replica "
                          f"({'' if m2n else 'and one trainer rank, '}"
                          f"--engine 1xT), all on one GPU")
    gpu = OneGpu(memory_bandwidth=args.hbm_gbps * 1e9, h2d_bandwidth=args.h2d_gbps * 1e9,
                 check_bandwidth=(args.check_gbps or args.hbm_gbps) * 1e9,
                 handover_s=args.handover_us * 1e-6)
    out = {"model": args.model, "path": args.one_gpu,
           **predict_one_gpu(args.one_gpu, model_tensors(args.model), gpu,
                             bucket_bytes=args.bucket_mb << 20, num_buffers=args.num_buffers,
                             senders=args.trainer_gpus)}
    return _emit(args, out, [
        f"{args.model}, {args.one_gpu} on one GPU: predicted {out['predicted_s']:.4f} s "
        f"(one copy {out['one_copy_s']:.4f} s, one host-to-device copy {out['one_h2d_s']:.4f} s)"])
