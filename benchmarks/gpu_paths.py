"""This wave's paths on one GPU, each against a floor measured in the same run.

    python benchmarks/gpu_paths.py [--model qwen3-8b] [--repeats 5]

1. Staged commit (`wtransfer.inference.updates.staging.StagedWeights`): the time of a `swap` commit
   (storages exchanged) and a `copy` commit (the shadow copied into the live storages) of a
   whole model, against one device-to-device copy of its bytes.
2. The delta sender's comparison (`wtransfer.trainer.deltas.DeltaSender`, its last-sent copy on
   the GPU): preparing an update at 0.03% and 1% changed elements, against one D2D copy.
3. Mixture of experts on CUDA: our engine with the tiny Qwen3-MoE model on the GPU, updated
   from a CPU trainer over ipc: the engine's weights equal the trainer's, and its greedy tokens
   equal a fresh engine on the GPU built with those weights.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Callable

import torch
from wtransfer_ipc import IPCTrainerInitInfo

import wtransfer
from wtransfer.inference import AsyncEngine, EngineConfig, LocalEngineClient, SamplingParams
from wtransfer.inference.model.decoder import load_model
from wtransfer.inference.updates.staging import StagedWeights
from wtransfer.shapes import build_module, model_metas, perturb
from wtransfer.trainer.deltas import DeltaSender
from wtransfer.trainer.source import ModuleSource

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import print_table, write_json


def timed(fn: Callable[[], object], repeats: int) -> float:
    """Median seconds of `fn` (device-synchronized) after one warm-up."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def d2d_floor(nbytes: int, repeats: int) -> float:
    """Median seconds of one device-to-device copy of `nbytes`."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return timed(lambda: dst.copy_(src), repeats)


def staged_rows(model: torch.nn.Module, nbytes: int, repeats: int) -> list[dict[str, object]]:
    """Commit times of swap and copy staging against one D2D copy."""
    floor = d2d_floor(nbytes, repeats)
    rows = []
    for mode in ("swap", "copy"):
        staged = StagedWeights(model, mode)

        def commit(staged: StagedWeights = staged) -> None:
            for name in staged.shadow:
                staged.dest(name)
            staged.commit("v")

        seconds = timed(commit, repeats)
        rows.append({"path": f"staged commit ({mode})", "ms": seconds * 1e3,
                     "floor": "one D2D copy", "floor_ms": floor * 1e3,
                     "ratio": seconds / floor})
        del staged
        torch.cuda.empty_cache()
    return rows


def delta_rows(model: torch.nn.Module, nbytes: int, repeats: int) -> list[dict[str, object]]:
    """The delta sender's prepare at two change rates against one D2D copy."""
    floor = d2d_floor(nbytes, repeats)
    source = ModuleSource(model)
    sender = DeltaSender(copy_device="cuda")
    rows = []
    full = sender.prepare(source)
    sender.landed(full)
    for fraction in (0.0003, 0.01):
        times, seen = [], []
        for step in range(repeats + 1):
            perturb(model, fraction, seed=step)
            torch.cuda.synchronize()
            start = time.perf_counter()
            update = sender.prepare(source)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
            sender.landed(update)
            seen.append(update.changed_fraction or 0.0)
        seconds = statistics.median(times[1:])
        rows.append({"path": f"delta prepare at {statistics.median(seen):.2%} changed",
                     "ms": seconds * 1e3, "floor": "one D2D copy", "floor_ms": floor * 1e3,
                     "ratio": seconds / floor})
    return rows


def moe_on_cuda() -> dict[str, object]:
    """The MoE engine on the GPU, updated over ipc from a CPU trainer."""
    async def main() -> dict[str, object]:
        greedy = SamplingParams(max_tokens=24, temperature=0.0)
        prompt = [5, 17, 33, 2]

        async def tokens(engine: AsyncEngine) -> list[int]:
            last = None
            async for out in engine.generate(prompt, greedy):
                last = out
            assert last is not None
            return list(last.outputs[0].token_ids)

        engine = AsyncEngine(EngineConfig(model="tiny-moe", seed=1, device="cuda"))
        fresh = AsyncEngine(EngineConfig(model="tiny-moe", seed=5, device="cuda"))
        try:
            trainer = load_model("tiny-moe", seed=5)
            sender = await asyncio.to_thread(
                wtransfer.trainer_init, IPCTrainerInitInfo(), client=LocalEngineClient(engine),
                source=wtransfer.ModuleSource(trainer))
            stats = await asyncio.to_thread(sender.send_weights, "moe-1")
            await asyncio.to_thread(sender.shutdown)
            exact = await engine.fingerprint() == wtransfer.fingerprint(trainer.state_dict())
            same = await tokens(engine) == await tokens(fresh)
            return {"bit_exact": exact, "tokens_equal_fresh": same, "update_ms":
                    stats.seconds * 1e3, "bytes": stats.bytes}
        finally:
            engine.shutdown()
            fresh.shutdown()

    return asyncio.run(main())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-8b")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_paths.py needs a CUDA device")
    metas = model_metas(args.model)
    nbytes = sum(m.nbytes for m in metas)
    model = build_module(metas, seed=1, device="cuda", fill="constant")
    print(f"{time.strftime('%H:%M:%S')} {args.model}: {nbytes / 1e9:.2f} GB", flush=True)
    rows = staged_rows(model, nbytes, args.repeats)
    print(f"{time.strftime('%H:%M:%S')} staged done", flush=True)
    model = build_module(metas, seed=1, device="cuda")  # random bits: deltas see real changes
    rows += delta_rows(model, nbytes, args.repeats)
    del model
    torch.cuda.empty_cache()
    print(f"{time.strftime('%H:%M:%S')} delta done", flush=True)
    print_table(rows, [("path", "path", ""), ("ms", "ms", ".2f"), ("floor", "floor", ""),
                       ("floor_ms", "floor ms", ".2f"), ("ratio", "ratio", ".2f")])
    moe = moe_on_cuda()
    print(f"MoE engine on CUDA: {moe}")
    write_json("gpu-paths", [*rows, {"path": "moe on cuda", **moe}], vars(args))
    if not (moe["bit_exact"] and moe["tokens_equal_fresh"]):
        raise SystemExit("the MoE engine on CUDA did not match")


if __name__ == "__main__":
    main()
