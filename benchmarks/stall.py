"""Benchmark: what a weight update costs a serving engine, paused against staged.

    python benchmarks/stall.py --models tiny,qwen3-0.6b --inflight 16 --updates 5
    python benchmarks/stall.py --device cuda --models qwen3-0.6b,qwen3-8b --inflight 16,64

A steady streaming load (`--inflight` greedy requests, each replaced as it finishes) runs on
an in-process engine while a trainer thread pushes its weights over ipc every `--every-s`:

- **none**: no updates (the floor: decode tokens/s, and the step interval, in the same run);
- **paused**: ``pause(keep, clear_cache)``, update in place, resume (``update_staging=off``);
- **staged**: the update lands in the shadow while the engine steps, committed by a swap at a
  step boundary, with the requests in flight re-prefilled (``update_staging=swap``);
- **staged keep KV**: the same, keeping the requests' KV (``update_reprefill=False``): what
  the commit alone costs;
- **staged copy**: staged, committed by copying the shadow into the live weights (their
  addresses stay: captured CUDA graphs stay valid);
- **none eager**: no updates, every step eager (no CUDA graphs): what the graphs bring.
- **none gather**: no updates, decode attention gathering its keys for SDPA
  (``paged_attention=False``): what reading the paged cache in place brings.

Where the trainer runs (`--trainer`): `thread`, a thread of the engine's process, as this
benchmark always did (its Python shares the engine's GIL with the step loop: a step that waits
for the GIL is slower); `process`, a process of its own reaching the engine over HTTP, as
`wtransfer serve` is reached in a deployment (the parent serves the engine on its own event
loop, as `wtransfer serve` does). `--switch-interval-ms` sets the engine process's GIL switch
interval (Python's default: 5 ms), to see how much of a slowdown is threads waiting for it.

The floor, measured in the same run on the same device: one read of every weight (a decode
step cannot take less); each mode's step interval is reported against it.

Per mode: tokens/s over the window (and its ratio to **none**), and per update the median of
`update_stall_ms` (the longest time the update kept the engine from computing: between the end
of one step and the start of the next) and, staged, of `update_commit_ms` (the swap itself).
Steps slowed beside a staged transfer, and the re-prefill after a commit (work every kept
request needs to be computed with the new weights; the paused path does the same after its
resume), are compute: they show in tokens/s. Where they go, per update (median): the serving
time lost while the transfer ran (`lost in`) and in the 0.4 s after it (`lost after`: the
commit, the re-prefill, decode graphs captured for new addresses), each against the token
rate of the 0.4 s before that update; `graphs built` counts decode graphs captured in the
measured window.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from wtransfer_ipc import IPCTrainerInitInfo

import wtransfer
from wtransfer.inference import AsyncEngine, EngineConfig, LocalEngineClient, SamplingParams
from wtransfer.inference.model.decoder import load_model

sys.path.insert(0, str(Path(__file__).parent))
from common import print_table, write_json

MODES: dict[str, dict[str, Any]] = {
         "none": {"update_staging": "off"}, "paused": {"update_staging": "off"},
         "staged": {"update_staging": "swap"},
         "staged keep KV": {"update_staging": "swap", "update_reprefill": False},
         "staged copy": {"update_staging": "copy"},
         "none eager": {"update_staging": "off", "cuda_graphs": False},
         "none gather": {"update_staging": "off", "paged_attention": False}}

BEFORE_S = 0.4
"""The window before each update whose token rate the update's losses are measured against."""
AFTER_S = 0.4
"""The window after each update's transfer its after-effects (commit, re-prefill, graphs
captured again) are counted in."""


async def load(engine: AsyncEngine, inflight: int, max_tokens: int, stop: asyncio.Event,
               counted: list[int]) -> None:
    """Keep `inflight` greedy requests streaming until `stop`; count every token."""

    async def one(i: int) -> None:
        n = 0
        while not stop.is_set():
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
            seen = 0
            async for out in engine.generate([i % 200 + 1, 5, 7], params):
                got = len(out.outputs[0].token_ids)
                counted[0] += got - seen
                seen = got
            n += 1

    await asyncio.gather(*(one(i) for i in range(inflight)))


async def step_interval(engine: AsyncEngine, window_s: float = 1.0) -> float:
    """Median seconds between the engine's steps, from its step counter, over a window."""
    samples = []
    for _ in range(5):
        a = (await engine.stats())["steps"]
        started = time.perf_counter()
        await asyncio.sleep(window_s / 5)
        b = (await engine.stats())["steps"]
        if b > a:
            samples.append((time.perf_counter() - started) / (b - a))
    return statistics.median(samples) if samples else float("nan")


def weight_read_ms(engine: AsyncEngine, repeats: int = 5) -> float:
    """Median time to read every weight of the engine's model once: one multi-tensor norm
    (a few kernel launches for all tensors, so a small model's floor is the memory's time, not
    that of launching a kernel per tensor)."""
    model = engine.core.replica.model  # type: ignore[attr-defined]  # (in process: an EngineCore)
    params = [p.detach() for p in model.parameters()]
    device = params[0].device
    times = []
    for _ in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        torch._foreach_norm(params)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times[1:])


async def sample_tokens(counted: list[int], trace: list[tuple[float, int]],
                        stop: asyncio.Event) -> None:
    """Record (time, tokens so far) every 5 ms until `stop`."""
    while not stop.is_set():
        trace.append((time.perf_counter(), counted[0]))
        await asyncio.sleep(0.005)


def tokens_between(trace: list[tuple[float, int]], a: float, b: float) -> float:
    """Tokens streamed between times `a` and `b`, from the samples nearest each."""
    times = [t for t, _ in trace]
    first = trace[min(bisect.bisect_left(times, a), len(trace) - 1)][1]
    last = trace[min(bisect.bisect_left(times, b), len(trace) - 1)][1]
    return float(last - first)


def serving_lost_ms(trace: list[tuple[float, int]], a: float, b: float,
                    rate: float) -> float:
    """How many ms of serving at `rate` tokens/s the window [a, b] lost."""
    return ((b - a) - tokens_between(trace, a, b) / rate) * 1e3


class TrainerThread:
    """The trainer as a thread of the engine's process (`LocalEngineClient`)."""

    def __init__(self, sender: Any) -> None:
        self.sender = sender

    @classmethod
    async def start(cls, engine: AsyncEngine, trainer: Any) -> TrainerThread:
        return cls(await asyncio.to_thread(
            wtransfer.trainer_init, IPCTrainerInitInfo(bucket_bytes=64 << 20, timeout_s=600),
            client=LocalEngineClient(engine), source=wtransfer.ModuleSource(trainer)))

    async def send(self, version: str) -> float:
        """One update; its seconds."""
        return float((await asyncio.to_thread(self.sender.send_weights, version)).seconds)

    async def close(self) -> None:
        self.sender.shutdown()


class TrainerProcess:
    """The trainer as a process of its own, reaching the engine over HTTP: the engine is
    served on this process's event loop (as `wtransfer serve` serves it); the child loads the
    same model on the same device and sends one update per line it reads."""

    def __init__(self, server: Any, serving: asyncio.Task[None],
                 child: asyncio.subprocess.Process) -> None:
        self.server, self.serving, self.child = server, serving, child

    @classmethod
    async def start(cls, engine: AsyncEngine, model: str, device: str) -> TrainerProcess:
        import uvicorn

        from wtransfer.inference.serving.server import build_app
        from wtransfer.launch.processes import free_port

        port = free_port()
        server = uvicorn.Server(uvicorn.Config(build_app(engine, dev_mode=True),
                                               host="127.0.0.1", port=port,
                                               log_level="warning"))
        serving = asyncio.create_task(server.serve())
        while not server.started:
            if serving.done():
                serving.result()
            await asyncio.sleep(0.02)
        child = await asyncio.create_subprocess_exec(
            sys.executable, __file__, "--trainer-child",
            json.dumps([f"http://127.0.0.1:{port}", model, device]),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
        self = cls(server, serving, child)
        try:
            await self._answer()  # the model loaded and the sender set up
        except BaseException:
            await self.close()
            raise
        return self

    async def _answer(self) -> dict[str, Any]:
        assert self.child.stdout is not None
        line = await asyncio.wait_for(self.child.stdout.readline(), 600)
        if not line:
            raise RuntimeError(f"the trainer process exited ({await self.child.wait()})")
        return dict(json.loads(line))

    async def send(self, version: str) -> float:
        """One update; its seconds, as the trainer measured them."""
        assert self.child.stdin is not None
        self.child.stdin.write(f"{version}\n".encode())
        await self.child.stdin.drain()
        return float((await self._answer())["seconds"])

    async def close(self) -> None:
        """End the child (killed if it does not exit within 120 s), then the server."""
        assert self.child.stdin is not None
        self.child.stdin.close()
        try:
            await asyncio.wait_for(self.child.wait(), 120)
        except TimeoutError:
            self.child.kill()
            await self.child.wait()
        finally:
            self.server.should_exit = True
            await asyncio.wait_for(self.serving, 60)


def trainer_child(url: str, model: str, device: str) -> None:
    """`TrainerProcess`'s child: load the model, then send one update per version read."""
    trainer = load_model(model, seed=1, device=device)
    sender = wtransfer.trainer_init(IPCTrainerInitInfo(bucket_bytes=64 << 20, timeout_s=600),
                                    client=wtransfer.HTTPClient(url, timeout_s=600),
                                    source=wtransfer.ModuleSource(trainer))
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        stats = sender.send_weights(line.strip())
        print(json.dumps({"seconds": stats.seconds}), flush=True)
    sender.shutdown()


async def run_mode(model: str, mode: str, inflight: int, updates: int, every_s: float,
                   max_tokens: int, device: str, placement: str) -> dict[str, Any]:
    updating = not mode.startswith("none")
    engine = AsyncEngine(EngineConfig(model=model, max_num_seqs=max(64, inflight),
                                      device=device, **MODES[mode]))
    floor = weight_read_ms(engine) if not updating else float("nan")
    trainer = (load_model(model, seed=1, device=device) if placement == "thread" or not updating
               else None)
    stop, counted = asyncio.Event(), [0]
    trace: list[tuple[float, int]] = []
    driving = asyncio.create_task(load(engine, inflight, max_tokens, stop, counted))
    sampling = asyncio.create_task(sample_tokens(counted, trace, stop))
    await asyncio.sleep(1.0)  # every request streaming
    trainer_at = await (TrainerProcess.start(engine, model, device) if placement == "process"
                        and updating else TrainerThread.start(engine, trainer))
    try:
        interval = await step_interval(engine)
        stalls, commits, transfers, windows = [], [], [], []
        graphs_before = (await engine.stats())["decode_graphs_built"]
        start, base = time.perf_counter(), counted[0]
        for k in range(updates if updating else 0):
            await asyncio.sleep(every_s)
            sent = time.perf_counter()
            if mode == "paused":
                await engine.pause_generation(mode="keep", clear_cache=True)
            seconds = await trainer_at.send(f"u{k}")
            if mode == "paused":
                await engine.resume_generation()
            windows.append((sent, time.perf_counter()))
            transfers.append(seconds * 1e3)
            info = await engine.weight_info()
            while info["update_stall_ms"] is None:  # the first step after it closes its window
                await asyncio.sleep(0.002)
                info = await engine.weight_info()
            stalls.append(info["update_stall_ms"])
            commits.append(info["update_commit_ms"])
        if not updating:
            await asyncio.sleep(every_s * updates)
        else:
            await asyncio.sleep(AFTER_S)
        elapsed = time.perf_counter() - start
        tokens = counted[0] - base
        graphs_built = (await engine.stats())["decode_graphs_built"] - graphs_before
        peak_gib = (torch.cuda.max_memory_allocated() / 2**30 if device.startswith("cuda")
                    else float("nan"))  # this process's: the trainer's copy where it is a thread
        stop.set()
        await engine.abort_requests()
        await asyncio.wait_for(driving, 120)
        await sampling
        lost_in, lost_after = [], []
        for sent, done in windows:  # against the rate of the steady window before each update
            rate = tokens_between(trace, sent - BEFORE_S, sent) / BEFORE_S
            if rate > 0:  # (else nothing streamed before it: nothing to lose against)
                lost_in.append(serving_lost_ms(trace, sent, done, rate))
                lost_after.append(serving_lost_ms(trace, done, done + AFTER_S, rate))
    finally:
        await trainer_at.close()
    engine.shutdown()
    del engine, trainer_at, trainer
    return {"model": model, "mode": mode, "inflight": inflight, "floor_ms": floor,
            "trainer": placement if updating else "",
            "tokens_per_s": tokens / elapsed,
            "step_ms": interval * 1e3,
            "transfer_ms": statistics.median(transfers) if transfers else float("nan"),
            "stall_ms": statistics.median(stalls) if stalls else float("nan"),
            "commit_ms": statistics.median(commits) if mode.startswith("staged")
            else float("nan"), "updates": len(stalls), "peak_gib": peak_gib,
            "graphs_built": graphs_built,
            "lost_in_ms": statistics.median(lost_in) if lost_in else float("nan"),
            "lost_after_ms": statistics.median(lost_after) if lost_after else float("nan")}


def one_mode_in_a_child(args: argparse.Namespace, model: str, mode: str,
                        inflight: int, placement: str) -> dict[str, Any]:
    """Run one mode in a process of its own, so nothing one mode held (a CUDA context, the
    trainer's exported storages, the allocator's cache) is there for the next."""
    out = subprocess.run([sys.executable, __file__, "--one", json.dumps([model, mode, inflight]),
                          "--device", args.device, "--updates", str(args.updates),
                          "--every-s", str(args.every_s), "--max-tokens", str(args.max_tokens),
                          "--trainer", placement,
                          "--switch-interval-ms", str(args.switch_interval_ms)],
                         capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        raise RuntimeError(f"{model} x{inflight} {mode} failed:\n{out.stderr[-3000:]}")
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="tiny,qwen3-0.6b")
    parser.add_argument("--inflight", default="16",
                        help="concurrent requests; several: comma-separated")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--modes", default="none,paused,staged,staged keep KV",
                        help=f"comma-separated, of: {', '.join(MODES)}")
    parser.add_argument("--updates", type=int, default=5)
    parser.add_argument("--every-s", type=float, default=1.0)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--trainer", default="thread",
                        help="where the trainer runs: thread (of the engine's process), process "
                        "(of its own, reaching the engine over HTTP); both: thread,process")
    parser.add_argument("--switch-interval-ms", type=float, default=5.0,
                        help="the engine process's GIL switch interval (Python's default 5)")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # [model, mode, inflight]: one row
    parser.add_argument("--trainer-child", help=argparse.SUPPRESS)  # [url, model, device]
    args = parser.parse_args()
    if args.trainer_child:
        trainer_child(*json.loads(args.trainer_child))
        return
    if args.one:
        sys.setswitchinterval(args.switch_interval_ms / 1e3)
        model, mode, inflight = json.loads(args.one)
        print(json.dumps(asyncio.run(run_mode(model, mode, inflight, args.updates,
                                              args.every_s, args.max_tokens, args.device,
                                              args.trainer))))
        return
    placements = [p.strip() for p in args.trainer.split(",")]
    if not set(placements) <= {"thread", "process"}:
        parser.error(f"--trainer takes thread, process or both, not {args.trainer!r}")
    if args.switch_interval_ms <= 0:
        parser.error("--switch-interval-ms must be above 0")
    rows = []
    for model in args.models.split(","):
        for inflight in [int(n) for n in args.inflight.split(",")]:
            mine = []
            modes = [m.strip() for m in args.modes.split(",")]
            runs = [("none", "thread"), *((m, p) for m in modes if m != "none"
                                          for p in (["thread"] if m.startswith("none")
                                                    else placements))]
            for mode, placement in runs:
                row = one_mode_in_a_child(args, model, mode, inflight, placement)
                mine.append(row)
                print(f"  {model} x{inflight} {mode} {row['trainer']}: "
                      f"{row['tokens_per_s']:.0f} tok/s, step "
                      f"{row['step_ms']:.1f} ms (weight read {mine[0]['floor_ms']:.1f} ms), "
                      f"stall {row['stall_ms']:.1f} ms", flush=True)
            floor = mine[0]
            for r in mine:
                r["vs_none"] = r["tokens_per_s"] / floor["tokens_per_s"]
                r["step_vs_floor"] = r["step_ms"] / floor["floor_ms"]
            rows += mine
    print_table(rows, [("model", "model", ""), ("inflight", "seqs", "d"), ("mode", "mode", ""),
                       ("trainer", "trainer", ""),
                       ("tokens_per_s", "tok/s", ".0f"), ("vs_none", "vs none", ".3f"),
                       ("step_ms", "step ms", ".2f"), ("step_vs_floor", "step/floor", ".2f"),
                       ("transfer_ms", "transfer ms", ".1f"),
                       ("stall_ms", "stall ms", ".2f"), ("commit_ms", "commit ms", ".3f"),
                       ("updates", "updates", "d"), ("peak_gib", "peak GiB", ".1f"),
                       ("graphs_built", "graphs built", "d"),
                       ("lost_in_ms", "lost in ms", ".1f"),
                       ("lost_after_ms", "lost after ms", ".1f")])
    print(f"wrote {write_json('stall', rows, vars(args))}")


if __name__ == "__main__":
    main()
