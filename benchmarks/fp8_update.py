"""An FP8 engine fed by a BF16 trainer, both ways, timed (one GPU, or CPU for a small model).

    python benchmarks/fp8_update.py [--model qwen3-0.6b] [--device cuda:0] [--repeats 3]
                                    [--ways floor,a,b]

The engine (`quantization="fp8"`) and the trainer (bf16, on the same device) run in one
process over ipc; per way the median `send_weights` time after one warm-up: (a) BF16 sent and
quantized by the engine, (b) quantized on the trainer (`Fp8Source`); the plain BF16 engine fed
BF16 is the floor. After each, the engine's fingerprint must equal a fresh FP8 engine's built
from the same weights, and greedy tokens (the FP8 forward on the device) must equal it too.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from typing import Any

from wtransfer_ipc import IPCTrainerInitInfo

import wtransfer
from wtransfer.inference import AsyncEngine, EngineConfig, LocalEngineClient, SamplingParams
from wtransfer.inference.model.decoder import load_model
from wtransfer.quant.source import Fp8Source

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import print_table, write_json

PROMPT = [11, 22, 33, 44, 55]


async def tokens(engine: AsyncEngine) -> list[int]:
    """Greedy tokens of one prompt."""
    last = None
    async for out in engine.generate(PROMPT, SamplingParams(max_tokens=16, temperature=0)):
        last = out
    assert last is not None
    return list(last.outputs[0].token_ids)


def stamp(what: str) -> None:
    """One progress line (a Qwen3-8B run spends minutes building models)."""
    print(f"{time.strftime('%H:%M:%S')} {what}", flush=True)


async def bench(model: str, device: str, repeats: int,
                ways: set[str]) -> list[dict[str, object]]:
    """The chosen ways, timed and checked."""
    base: dict[str, Any] = dict(model=model, device=device, dtype="bfloat16",
                                update_staging="off", update_rollback=False)
    trainer = load_model(model, seed=5, device=device, dtype="bfloat16")
    fresh = AsyncEngine(EngineConfig(seed=5, quantization="fp8", **base))
    want, want_tokens = await fresh.fingerprint(), await tokens(fresh)
    fresh.shutdown()
    stamp("trainer and fresh fp8 engine built")
    rows = []
    for key, way, quantized, source in (
            ("floor", "bf16 engine, bf16 sent (floor)", False, wtransfer.ModuleSource(trainer)),
            ("a", "fp8 engine, bf16 sent (a)", True, wtransfer.ModuleSource(trainer)),
            ("b", "fp8 engine, fp8 sent (b)", True, Fp8Source(wtransfer.ModuleSource(trainer)))):
        if key not in ways:
            continue
        engine = AsyncEngine(EngineConfig(seed=1, quantization="fp8" if quantized else None,
                                          **base))
        sender = await asyncio.to_thread(wtransfer.trainer_init, IPCTrainerInitInfo(
            device=device if device != "cpu" else None), client=LocalEngineClient(engine),
            source=source)
        stamp(f"{way}: engine and sender ready")
        times, moved = [], 0
        for _ in range(repeats + 1):
            start = time.perf_counter()
            moved = (await asyncio.to_thread(sender.send_weights)).bytes
            times.append(time.perf_counter() - start)
        await asyncio.to_thread(sender.shutdown)
        exact = (await engine.fingerprint() == want) if quantized else None
        same = (await tokens(engine) == want_tokens) if quantized else None
        engine.shutdown()
        rows.append({"way": way, "ms": statistics.median(times[1:]) * 1e3,
                     "gb": moved / 1e9, "bit_exact": exact, "tokens_equal": same})
        stamp(str(rows[-1]))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ways", default="floor,a,b", help="which of floor, a, b to run")
    args = parser.parse_args()
    ways = set(args.ways.split(","))
    if not ways <= {"floor", "a", "b"}:
        parser.error(f"--ways takes floor, a and b; got {args.ways!r}")
    rows = asyncio.run(bench(args.model, args.device, args.repeats, ways))
    print_table(rows, [("way", "way", ""), ("ms", "median ms", ".1f"), ("gb", "GB moved", ".3f"),
                       ("bit_exact", "= fresh fp8", ""), ("tokens_equal", "tokens =", "")])
    write_json("fp8-update", rows, vars(args))
    if any(r["bit_exact"] is False or r["tokens_equal"] is False for r in rows):
        raise SystemExit("an FP8 engine differs from a fresh one")


if __name__ == "__main__":
    main()
