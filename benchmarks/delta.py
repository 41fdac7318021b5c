"""Delta updates against full ones, with a real optimizer making the changes.

    python benchmarks/delta.py [--model qwen3-0.6b] [--backends ipc,nccl] [--steps 20]
                               [--lrs 1e-6,1e-5,1e-4] [--device cpu|cuda:0]

A Qwen3-shaped bf16 model is trained by AdamW (its gradient each step: a fixed random
direction per tensor times a fresh random scale, so the optimizer's moments move as in
training while the benchmark does not spend its time on a backward pass). After every step
the same weights go to two receiver processes of the same backend: one by a sender with
`delta=True`, one by a plain sender (the floor, measured in the same step; which of the two
sends first alternates from step to step). Printed per
learning rate: the fraction of elements whose bits changed, bytes on the wire, and the median
update time of each, with their ratio; after the last step both receivers' fingerprints must
equal the trainer's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import torch

from wtransfer.fingerprint import fingerprint
from wtransfer.registry import trainer_init
from wtransfer.shapes import build_module, model_metas
from wtransfer.trainer.source import ModuleSource

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import print_table, write_json
from transfer import receivers, trainer_info


class SyntheticGradients:
    """Per tensor a fixed random direction; each step's gradient is it times a random scale."""

    def __init__(self, model: torch.nn.Module, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.params = [p for p in model.parameters() if p.is_floating_point()]
        self.directions = [torch.randn(p.shape, generator=gen).to(p.dtype).to(p.device)
                           for p in self.params]
        self.gen = gen

    def fill(self) -> None:
        """Set every parameter's `.grad` for one step."""
        for p, d in zip(self.params, self.directions, strict=True):
            scale = float(torch.rand((), generator=self.gen)) + 0.5
            p.grad = d * scale


def bench_lr(backend: str, name: str, lr: float, steps: int, device: str) -> dict[str, Any]:
    """Train `steps` steps at `lr`; each step's update by delta and in full."""
    model = build_module(model_metas(name), seed=1, device=device)
    for p in model.parameters():
        p.requires_grad_(True)
    grads = SyntheticGradients(model, seed=2)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, foreach=False)
    rows: dict[str, list[float]] = {"delta_s": [], "full_s": [], "changed": [], "wire": []}
    with receivers(backend, name, [device]) as delta_client, \
            receivers(backend, name, [device]) as full_client:
        delta = trainer_init(trainer_info(backend, delta=True, bucket_bytes=64 << 20),
                             client=delta_client, source=ModuleSource(model))
        full = trainer_init(trainer_info(backend, bucket_bytes=64 << 20),
                            client=full_client, source=ModuleSource(model))
        with delta, full:
            first = delta.send_weights("0")
            full.send_weights("0")
            for step in range(1, steps + 1):
                grads.fill()
                opt.step()
                opt.zero_grad(set_to_none=True)
                if step % 2:  # who sends first after the optimizer step alternates: the
                    f = full.send_weights(str(step))  # first reads freshly written weights
                    d = delta.send_weights(str(step))
                else:
                    d = delta.send_weights(str(step))
                    f = full.send_weights(str(step))
                rows["delta_s"].append(d.seconds)
                rows["full_s"].append(f.seconds)
                if d.changed_fraction is not None:  # a delta (not one of a full run)
                    rows["changed"].append(d.changed_fraction)
                rows["wire"].append(float(d.wire_bytes or d.bytes))
                what = (f"changed {d.changed_fraction:.4%}" if d.changed_fraction is not None
                        else "sent in full")
                print(f"  {time.strftime('%H:%M:%S')} lr {lr:g} step {step}: {what}, "
                      f"wire {rows['wire'][-1] / 1e6:.1f} MB, "
                      f"delta {d.seconds * 1e3:.0f} ms, full {f.seconds * 1e3:.0f} ms",
                      flush=True)
            want = fingerprint(model.state_dict())
            exact = delta_client.fingerprint() == want == full_client.fingerprint()
    med = {k: statistics.median(v) if v else 0.0 for k, v in rows.items()}
    mean = {k: statistics.fmean(rows[k]) for k in ("delta_s", "full_s")}
    return {"backend": backend, "model": name, "lr": lr, "steps": steps,
            "changed": med["changed"] if rows["changed"] else float("nan"),  # (no delta)
            "model_mb": first.bytes / 1e6,
            "delta_mean_ms": mean["delta_s"] * 1e3, "full_mean_ms": mean["full_s"] * 1e3,
            "mean_speedup": mean["full_s"] / mean["delta_s"],
            "wire_mb": med["wire"] / 1e6, "bytes_ratio": first.bytes / max(med["wire"], 1),
            "delta_ms": med["delta_s"] * 1e3, "full_ms": med["full_s"] * 1e3,
            "speedup": med["full_s"] / med["delta_s"], "bit_exact": exact}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--backends", default="ipc,nccl")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lrs", default="1e-6,1e-5,1e-4")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.manual_seed(0)
    rows = []
    for backend in args.backends.split(","):
        for lr in (float(x) for x in args.lrs.split(",")):
            rows.append(bench_lr(backend, args.model, lr, args.steps, args.device))
    print(f"\ndelta vs full updates, {args.model}, AdamW, median (and mean) of "
          f"{args.steps} steps ({args.device}; changed: median over the steps sent as deltas)")
    print_table(rows, [("backend", "backend", ""), ("lr", "lr", "g"),
                       ("changed", "changed", ".3%"), ("model_mb", "model MB", ".0f"),
                       ("wire_mb", "wire MB", ".1f"), ("bytes_ratio", "fewer bytes", ".1f"),
                       ("delta_ms", "delta ms", ".0f"), ("full_ms", "full ms", ".0f"),
                       ("speedup", "speedup", ".2f"), ("delta_mean_ms", "delta mean", ".0f"),
                       ("full_mean_ms", "full mean", ".0f"), ("mean_speedup", "mean speedup",
                                                               ".2f"),
                       ("bit_exact", "bit-exact", "")])
    write_json("delta", rows, vars(args))
    if not all(r["bit_exact"] for r in rows):
        raise SystemExit("a receiver's weights differ from the trainer's")


if __name__ == "__main__":
    main()
