"""Benchmark: wtransfer side by side with a peer, checkpoint-engine 0.4.2 (MoonshotAI), on one GPU.

    python benchmarks/peers.py                          # Qwen3-8B shapes, bf16 (16.4 GB)
    python benchmarks/peers.py --model qwen3-0.6b       # a quick run (1.19 GB)
    python benchmarks/peers.py --skip-ce                # wtransfer and the floors only

Everything runs on cuda:0 with the same weights (Qwen3-shaped bf16 tensors from
`wtransfer.shapes`, random values drawn on the GPU) into the same engine: a child process holding
the model on cuda:0 that loads every update into it through `ModuleTarget` (wtransfer writes
each tensor's bytes into its parameter; checkpoint-engine's worker calls the target's
`load_weights`, as vLLM's worker calls its model's). Rows, all measured in one run, their updates
interleaved (one round runs every row once; one warm-up round, then the median of 5):

* checkpoint-engine: a `ParameterServer` of world size 1 (NCCL, its own TCP store) with the
  weights registered once (`register_checkpoint(named_tensors=...)` from the trainer's pinned
  host tensors into its shared pinned pool) and `gather_metas`; each update is
  `ps.update(name, req_func)`, whose `req_func` asks the engine to run
  `checkpoint_engine.worker.update_weights_from_ipc` on the socket `ps.update` hands it (as
  vLLM's `/collective_rpc` does), and returns once that worker returned. Three rows: `update`
  with a process group kept across updates (`auto_pg=False`, its fastest steady state: the
  reference of the "x CE" column); `update` as with `auto_pg=True`, its recommended mode, where
  every update creates and destroys the process group (the server's flag is set for that row:
  only `gather_metas` and `update` read it); and `register + gather + update` each
  step (the trainer's new weights copied into the pool first: a step whose weights changed).
* wtransfer ipc from the same pinned host tensors: every setting at its default (a lone
  sender of pinned host tensors stages through CUDA, 1 GiB buckets), packed through shared
  memory (`device="cpu"`, the default before 2026-12-06), and packed through CUDA staging on
  cuda:0 (`device="cuda:0"`) at the bucket sizes asked for.
* wtransfer ipc from GPU-resident trainer tensors: zero-copy (the default) and packed.
* floors: one host-to-device copy of every byte from page-locked memory (the floor of the host
  rows) and one device-to-device copy (the floor of the GPU rows).

Before every update the engine overwrites all of its weights with a filler byte; after it, the
engine's per-tensor checksums (computed on the GPU) must equal the source's, or the row is not
bit-exact. Ratios: vs floor = floor time / this time (at most about 1), x CE = checkpoint-engine's
update time / this time (above 1: faster than checkpoint-engine).

checkpoint-engine pickles its own control messages (IPC handles, tensor lists); wtransfer's wire
is msgpack, and this script's control of the engine is JSON lines on the child's stdin.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import statistics
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from wtransfer_ipc.info import IPCTrainerInitInfo

import wtransfer
from wtransfer.control.rpc import ReceiverServer, RPCClient
from wtransfer.launch.processes import free_port
from wtransfer.packing import DTYPES, TensorMeta, byte_view
from wtransfer.receiver.target import ModuleTarget
from wtransfer.registry import create_receiver
from wtransfer.shapes import MODEL_SHAPES, build_module, model_metas

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import print_table, write_json

CE_VERSION = "0.4.2"
CHECKPOINT = "wtransfer-peers"
"""The checkpoint name registered with checkpoint-engine's parameter server."""
DEVICE = "cuda:0"
ALIGN = 256
FILLER = 0x5A
"""The byte the engine overwrites its weights with before every update."""
FAMILIES = ("floor-h2d", "ce", "ce-auto-pg", "ce-register", "wt-host-default", "wt-host-shm",
            "wt-host-cuda", "floor-d2d", "wt-gpu-zero-copy", "wt-gpu-packed")
"""The row families, in the order a round runs them (and the table lists them)."""
NO_CUDA = ("benchmarks/peers.py needs one CUDA GPU (torch.cuda.is_available() is False): the "
           "trainer, the engine process and checkpoint-engine all run on cuda:0")


# -- checksums ---------------------------------------------------------------------------------

_CHUNK = 1 << 26
"""32-bit words per step of the position-weighted sum (bounds its int64 temporaries)."""


@torch.no_grad()
def checksums(named: Iterable[tuple[str, torch.Tensor]],
              device: str = DEVICE) -> dict[str, list[int]]:
    """Per tensor, two int64 sums over its bytes read as 32-bit words, computed on `device`:
    the plain sum and a sum weighted by each word's position (mod 65521, plus one), so a lost,
    stale or misplaced word changes them. Tensors elsewhere are copied there one at a time."""
    names: list[str] = []
    parts: list[torch.Tensor] = []
    for name, tensor in named:
        data = byte_view(tensor.detach()).to(device)
        n4 = data.numel() // 4 * 4
        head = data[:n4] if data.storage_offset() % 4 == 0 else data[:n4].clone()
        words = head.view(torch.int32)
        plain = words.sum(dtype=torch.int64) + data[n4:].sum(dtype=torch.int64)
        weighted = torch.zeros((), dtype=torch.int64, device=device)
        for start in range(0, words.numel(), _CHUNK):
            chunk = words[start : start + _CHUNK].to(torch.int64)
            pos = torch.arange(start, start + chunk.numel(), dtype=torch.int64, device=device)
            weighted += chunk.mul_(pos.remainder_(65521).add_(1)).sum()
        names.append(name)
        parts.append(torch.stack([plain, weighted]))
    values = torch.stack(parts).tolist() if parts else []
    return dict(zip(names, values, strict=True))


def mismatches(got: dict[str, list[int]], want: dict[str, list[int]]) -> int:
    """How many tensors differ between two `checksums` results (missing or extra ones count)."""
    return sum(got.get(name) != sums for name, sums in want.items()) + len(set(got) - set(want))


# -- the engine process ------------------------------------------------------------------------

def run_engine(args: argparse.Namespace) -> None:
    """The engine child: the model on cuda:0, one wtransfer ipc receiver (RPC server) per
    wtransfer row, and checkpoint-engine's worker on request; serves JSON-line commands on stdin
    (``poison``, ``checksums``, ``ce``) until stdin closes."""
    if not torch.cuda.is_available():
        sys.exit(NO_CUDA)
    torch.cuda.set_device(DEVICE)
    module = build_module(model_metas(args.model), seed=2, device=DEVICE, fill="constant")
    state = module.state_dict()
    target = ModuleTarget(module)
    receivers = [create_receiver("ipc", ModuleTarget(module), device=DEVICE)
                 for _ in range(args.receivers)]
    servers = [ReceiverServer(r, "tcp://127.0.0.1:0").start() for r in receivers]
    update_from_ipc: Callable[..., None] | None = None
    zmq_ctx: Any = None
    if args.ce:
        import zmq
        from checkpoint_engine.worker import update_weights_from_ipc

        quiet_loguru(args.verbose)
        zmq_ctx, update_from_ipc = zmq.Context(), update_weights_from_ipc

    def handle(cmd: dict[str, Any]) -> dict[str, Any]:
        op = cmd.get("op")
        if op == "poison":
            with torch.no_grad():
                for t in state.values():
                    byte_view(t).fill_(FILLER)
            torch.cuda.synchronize()
            return {"ok": True}
        if op == "checksums":
            return {"ok": True, "sums": checksums(state.items())}
        if op == "ce" and update_from_ipc is not None:
            # what vLLM's worker extension does, with this engine's loader
            update_from_ipc(zmq_ctx, cmd["handle"], device_id=torch.cuda.current_device(),
                            run=target.load_weights, post_hook=None)
            return {"ok": True}
        return {"ok": False, "error": f"unknown command {op!r}"}

    print(json.dumps({"addresses": [s.address for s in servers], "pid": os.getpid()}),
          flush=True)
    while line := sys.stdin.readline():
        try:
            reply = handle(json.loads(line))
        except Exception:  # reported to the parent, which fails the run
            reply = {"ok": False, "error": traceback.format_exc()[-6000:]}
        print(json.dumps(reply), flush=True)
    for server in servers:
        server.close()
    for receiver in receivers:
        receiver.shutdown()
    os._exit(0)  # checkpoint-engine's and zmq's threads must not keep the child alive


class EngineProcess:
    """The parent's handle on the engine child (`run_engine`): JSON commands on its stdin, one
    JSON reply line each on its stdout, read by a thread of its own."""

    def __init__(self, model: str, receivers: int, ce: bool, verbose: bool,
                 start_timeout_s: float = 600.0) -> None:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--engine-child", "--model", model,
               "--receivers", str(receivers)]
        cmd += ["--ce"] if ce else []
        cmd += ["--verbose"] if verbose else []
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env={**os.environ, "PYTHONFAULTHANDLER": "1"})
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._lock = threading.Lock()
        threading.Thread(target=self._read, name="engine-stdout", daemon=True).start()
        self.info = self._next(start_timeout_s)
        self.addresses: list[str] = list(self.info["addresses"])

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in iter(self.proc.stdout.readline, ""):
            if line.startswith("{"):
                self._lines.put(line)
        self._lines.put(None)

    def _next(self, timeout_s: float) -> dict[str, Any]:
        try:
            line = self._lines.get(timeout=timeout_s)
        except queue.Empty:
            raise TimeoutError(f"the engine process said nothing within {timeout_s} s") from None
        if line is None:
            raise RuntimeError(f"the engine process exited ({self.proc.wait()})")
        return dict(json.loads(line))

    def call(self, op: str, timeout_s: float = 600.0, **fields: Any) -> dict[str, Any]:
        """Run command `op` in the engine and return its reply; raises if it failed."""
        with self._lock:
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps({"op": op, **fields}) + "\n")
            self.proc.stdin.flush()
            reply = self._next(timeout_s)
        if not reply.get("ok"):
            raise RuntimeError(f"engine command {op!r} failed:\n{reply.get('error')}")
        return reply

    def close(self) -> None:
        """Close its stdin (it exits); kill it if it has not within 60 s."""
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


# -- the trainer's tensors ---------------------------------------------------------------------

class PinnedHost:
    """Every tensor of `metas` in one page-locked host buffer (256-byte aligned views): the
    trainer's host copy. Pinned in place with ``cudaHostRegister`` (as checkpoint-engine pins
    its /dev/shm files), or where that fails allocated pinned by torch (rounded up to a power
    of two by its host allocator)."""

    def __init__(self, metas: list[TensorMeta]) -> None:
        offsets, size = [], 0
        for meta in metas:
            offsets.append(size)
            size += -(-meta.nbytes // ALIGN) * ALIGN
        self.flat = torch.empty(max(size, 1), dtype=torch.uint8)
        self.registered = _host_register(self.flat)
        if not self.registered:
            self.flat = torch.empty(max(size, 1), dtype=torch.uint8, pin_memory=True)
        self.tensors = {
            m.name: self.flat[o : o + m.nbytes].view(DTYPES[m.dtype]).view(m.shape)
            for m, o in zip(metas, offsets, strict=True)}

    def close(self) -> None:
        """Unpin a registered buffer."""
        if self.registered:
            torch.cuda.cudart().cudaHostUnregister(self.flat.data_ptr())
            self.registered = False


def _host_register(t: torch.Tensor) -> bool:
    try:
        return int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel(), 0)) == 0
    except (AttributeError, RuntimeError):
        return False


def module_over(metas: list[TensorMeta], tensors: dict[str, torch.Tensor]) -> nn.Module:
    """An `nn.Module` whose state dict is exactly `tensors` (no copy), in the order of `metas`."""
    root = build_module(metas, 0, device="meta", fill="constant")
    for meta in metas:
        path, _, leaf = meta.name.rpartition(".")
        node = root.get_submodule(path)
        tensor = tensors[meta.name]
        if leaf in dict(node.named_parameters(recurse=False)):
            setattr(node, leaf, nn.Parameter(tensor, requires_grad=False))
        else:
            node.register_buffer(leaf, tensor)
    return root


@torch.no_grad()
def gpu_trainer(metas: list[TensorMeta], seed: int) -> nn.Module:
    """The GPU-resident trainer: `metas` on cuda:0, floats drawn from N(0, 1) on the GPU."""
    module = build_module(metas, seed, device=DEVICE, fill="constant")
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    for t in module.state_dict().values():
        if t.is_floating_point() and t.numel():
            t.normal_(generator=gen)
    return module


# -- checkpoint-engine -------------------------------------------------------------------------

def quiet_loguru(verbose: bool) -> None:
    """checkpoint-engine logs every bucket at INFO through loguru: keep warnings only."""
    if not verbose:
        from loguru import logger

        logger.remove()
        logger.add(sys.stderr, level="WARNING")


class CheckpointEngine:
    """checkpoint-engine's side: one `ParameterServer` (rank 0 of 1, NCCL, its own TCP store on
    127.0.0.1) holding the host tensors in its shared pinned pool; its `req_func` has the engine
    run `update_weights_from_ipc` on the socket the server binds."""

    def __init__(self, engine: EngineProcess, host: dict[str, torch.Tensor],
                 settle_s: float, verbose: bool) -> None:
        import checkpoint_engine.distributed as ce_dist
        import checkpoint_engine.ps as ce_ps

        quiet_loguru(verbose)
        self.dist = ce_dist
        self.engine, self.host, self.settle_s = engine, host, settle_s
        port = free_port()
        # ParameterServer reads RANK itself when rank is 0 (falsy); P2PStore reads it too
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port - 1))  # its default store port is MASTER_PORT+1
        try:
            ce_ps.get_ip()
        except OSError:  # no route and no resolvable hostname: gather_metas only records it
            ce_ps.get_ip = lambda: "127.0.0.1"
        self.ps = ce_ps.ParameterServer(rank=0, world_size=1, auto_pg=False,
                                        master_addr="127.0.0.1", master_port=port)
        self.device_uuid = ce_ps._get_physical_gpu_id(self.ps.device_manager, 0)
        self.ps.init_process_group()
        start = time.perf_counter()
        self.ps.register_checkpoint(CHECKPOINT, named_tensors=host, use_shared_memory_pool=True)
        self.first_register_s = time.perf_counter() - start
        self.ps.gather_metas(CHECKPOINT)

    def _request(self, socket_paths: list[tuple[str, str]]) -> None:
        """The `req_func`: ask the engine to load from the server's socket for this GPU, and
        return once it did (an HTTP `/collective_rpc` to vLLM returns then too). A failure here
        leaves the server waiting on its socket forever, so it ends the benchmark."""
        try:
            self.engine.call("ce", handle=dict(socket_paths)[self.device_uuid])
        except BaseException:
            traceback.print_exc()
            sys.stderr.write("checkpoint-engine's worker failed: ending the benchmark\n")
            sys.stderr.flush()
            os._exit(3)

    def keep_group(self) -> None:
        """Before a row that keeps the process group: have one (created outside the timing)."""
        self.ps._auto_pg = False
        if not self.dist.is_initialized():
            self.ps.init_process_group()

    def auto_group(self) -> None:
        """Before the auto_pg row: no process group, so `update` creates and destroys one, as
        in a `ParameterServer(auto_pg=True)` (the flag is only read by gather_metas and update)."""
        if self.dist.is_initialized():
            self.dist.destroy_process_group()
        self.ps._auto_pg = True

    def settle(self) -> None:
        """After an update, outside the timing: back to a kept group's mode, and a pause (its
        own tests sleep 3 s between updates, to let a destroyed process group go)."""
        self.ps._auto_pg = False
        time.sleep(self.settle_s)

    def update(self) -> None:
        """One update of the registered weights into the engine."""
        self.ps.update(CHECKPOINT, self._request)

    def register_and_update(self) -> None:
        """One step whose weights changed: copy them into the pool again, gather, update."""
        self.ps.unregister_checkpoint(CHECKPOINT)  # the shared pool stays (no force)
        self.ps.register_checkpoint(CHECKPOINT, named_tensors=self.host,
                                    use_shared_memory_pool=True)
        self.ps.gather_metas(CHECKPOINT)
        self.ps.update(CHECKPOINT, self._request)

    def close(self) -> None:
        """Free the pinned pool and the process group."""
        self.ps.unregister_checkpoint(CHECKPOINT, force=True)
        if self.dist.is_initialized():
            self.dist.destroy_process_group()


# -- the run -----------------------------------------------------------------------------------

@dataclass
class Row:
    """One measured path: what one round runs (`run`, timed), around it (`prepare`, `after`,
    untimed), its floor and what it measured."""

    family: str
    key: str
    label: str
    run: Callable[[], object]
    floor: str | None
    bucket_mb: int = 0
    verify: bool = True
    prepare: Callable[[], object] | None = None
    after: Callable[[], object] | None = None
    times: list[float] = field(default_factory=list)
    first_s: float = float("nan")
    mismatched: int = 0


def selected(keys: str) -> set[str]:
    """The row families named in ``--paths`` (all by default)."""
    if keys == "all":
        return set(FAMILIES)
    chosen = {k.strip() for k in keys.split(",") if k.strip()}
    unknown = chosen - set(FAMILIES)
    if unknown:
        sys.exit(f"unknown --paths {sorted(unknown)}; choose from {', '.join(FAMILIES)}")
    return chosen


def wtransfer_rows(families: set[str], buckets_mb: list[int], num_buffers: int
                   ) -> list[tuple[str, str, str, int, IPCTrainerInitInfo, str]]:
    """(family, key, label, bucket MiB, trainer init info, source "host" or "gpu") of each
    wtransfer row asked for."""
    out = []
    if "wt-host-default" in families:
        out.append(("wt-host-default", "wt-host-default", "wtransfer ipc, host, every default",
                    0, IPCTrainerInitInfo(timeout_s=600), "host"))
    for mb in buckets_mb:
        if "wt-host-shm" in families:
            out.append(("wt-host-shm", f"wt-host-shm-{mb}", "wtransfer ipc, host, packed via shm",
                        mb, IPCTrainerInitInfo(bucket_bytes=mb << 20, num_buffers=num_buffers,
                                               device="cpu", timeout_s=600), "host"))
        if "wt-host-cuda" in families:
            out.append(("wt-host-cuda", f"wt-host-cuda-{mb}",
                        "wtransfer ipc, host, packed via cuda:0", mb,
                        IPCTrainerInitInfo(bucket_bytes=mb << 20, num_buffers=num_buffers,
                                           device=DEVICE, zero_copy=False, timeout_s=600),
                        "host"))
        if "wt-gpu-packed" in families:
            out.append(("wt-gpu-packed", f"wt-gpu-packed-{mb}", "wtransfer ipc, gpu, packed", mb,
                        IPCTrainerInitInfo(bucket_bytes=mb << 20, num_buffers=num_buffers,
                                           zero_copy=False, timeout_s=600), "gpu"))
    if "wt-gpu-zero-copy" in families:
        out.append(("wt-gpu-zero-copy", "wt-gpu-zero-copy", "wtransfer ipc, gpu, zero-copy", 0,
                    IPCTrainerInitInfo(timeout_s=600), "gpu"))
    return out


def bench(args: argparse.Namespace) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Every row asked for, interleaved round by round; the table's rows and the run's facts."""
    families = selected(args.paths)
    use_ce = not args.skip_ce and bool(families & {"ce", "ce-auto-pg", "ce-register"})
    metas = model_metas(args.model)
    total = sum(m.nbytes for m in metas)
    torch.cuda.set_device(DEVICE)
    facts: dict[str, Any] = {"bytes": total, "tensors": len(metas), "skipped": {}}
    print(f"{args.model}: {len(metas)} tensors, {total / 1e9:.2f} GB on "
          f"{torch.cuda.get_device_name(0)}; building the trainer's tensors", flush=True)

    gpu_model = gpu_trainer(metas, seed=1)
    host = PinnedHost(metas)
    for name, t in gpu_model.state_dict().items():
        host.tensors[name].copy_(t)
    host_model = module_over(metas, host.tensors)
    reference = checksums(gpu_model.state_dict().items())
    if checksums(host.tensors.items()) != reference:
        sys.exit("the host copy of the trainer's tensors differs from the GPU's")
    facts["host_pinning"] = "cudaHostRegister" if host.registered else "pin_memory"
    facts["host_is_pinned"] = bool(next(iter(host.tensors.values())).is_pinned())
    floor_src = torch.zeros(total, dtype=torch.uint8, device=DEVICE)
    floor_dst = torch.zeros_like(floor_src)
    host_bytes = host.flat[:total]

    def h2d() -> None:
        floor_dst.copy_(host_bytes, non_blocking=True)
        torch.cuda.synchronize()

    def d2d() -> None:
        floor_dst.copy_(floor_src)
        torch.cuda.synchronize()

    wt_specs = wtransfer_rows(families, [int(x) for x in args.bucket_mb.split(",")],
                              args.num_buffers)
    rows: list[Row] = []
    with contextlib.ExitStack() as stack:
        stack.callback(host.close)
        engine = EngineProcess(args.model, len(wt_specs), use_ce, args.verbose)
        stack.callback(engine.close)
        single: list[tuple[str, str, Callable[[], object], str | None, Any, Any]] = [
            ("floor-h2d", "floor: 1 H2D copy from pinned memory", h2d, None, None, None),
            ("floor-d2d", "floor: 1 D2D copy", d2d, None, None, None)]
        if use_ce:
            print("registering the weights with checkpoint-engine", flush=True)
            ce = CheckpointEngine(engine, host.tensors, args.ce_settle_s, args.verbose)
            stack.callback(ce.close)
            facts["ce_first_register_s"] = ce.first_register_s
            single += [
                ("ce", "checkpoint-engine update (kept group)", ce.update, "floor-h2d",
                 ce.keep_group, ce.settle),
                ("ce-auto-pg", "checkpoint-engine update (auto_pg)", ce.update, "floor-h2d",
                 ce.auto_group, ce.settle),
                ("ce-register", "checkpoint-engine register+gather+update",
                 ce.register_and_update, "floor-h2d", ce.keep_group, ce.settle)]
        for key, label, run, floor, prepare, after in single:
            if key in families:
                rows.append(Row(key, key, label, run, floor, verify=floor is not None,
                                prepare=prepare, after=after))
        for (family, key, label, mb, info, where), address in zip(wt_specs, engine.addresses,
                                                                  strict=True):
            client = RPCClient(address, timeout_s=600)
            stack.callback(client.close)
            source = wtransfer.ModuleSource(host_model if where == "host" else gpu_model)
            try:
                sender = stack.enter_context(
                    wtransfer.trainer_init(info, client=client, source=source))
            except Exception as exc:  # e.g. /dev/shm too small for the staging buffers
                print(f"skipping {key}: {exc}", flush=True)
                facts["skipped"][key] = str(exc)
                continue
            facts.setdefault("staging", {})[key] = (  # what each sender chose
                f"{getattr(sender, 'device', '?')}, {sender.bucket_bytes >> 20} MiB x "
                f"{sender.num_buffers}")
            rows.append(Row(family, key, label, sender.send_weights,
                            "floor-h2d" if where == "host" else "floor-d2d", bucket_mb=mb))
        rows.sort(key=lambda row: FAMILIES.index(row.family))  # stable: buckets stay in order
        for r in range(args.warmup + args.repeats):
            measured: list[str] = []
            for row in rows:
                if row.prepare is not None:
                    row.prepare()
                if row.verify:
                    engine.call("poison")
                torch.cuda.synchronize()
                start = time.perf_counter()
                row.run()
                torch.cuda.synchronize()
                seconds = time.perf_counter() - start
                if row.after is not None:
                    row.after()
                if row.verify:
                    bad = mismatches(engine.call("checksums")["sums"], reference)
                    row.mismatched = max(row.mismatched, bad)
                if r == 0:
                    row.first_s = seconds
                if r >= args.warmup:
                    row.times.append(seconds)
                measured.append(f"{row.key} {seconds * 1e3:.1f}")
            done = "warm-up" if r < args.warmup else f"round {r - args.warmup + 1}/{args.repeats}"
            print(f"{done} (ms): " + "  ".join(measured), flush=True)
    medians = {row.key: statistics.median(row.times) for row in rows}
    ce_s = medians.get("ce", float("nan"))
    table = []
    for row in rows:
        seconds = medians[row.key]
        floor_s = medians.get(row.floor or row.key, float("nan"))
        table.append({
            "model": args.model, "key": row.key, "path": row.label,
            "bucket": str(row.bucket_mb) if row.bucket_mb else "-", "bucket_mb": row.bucket_mb,
            "seconds": seconds, "ms": seconds * 1e3, "min_s": min(row.times),
            "max_s": max(row.times), "times": row.times, "first_s": row.first_s,
            "bytes": total, "tensors": len(metas), "gbps": total / seconds / 1e9,
            "floor": row.floor or row.key, "vs_floor": floor_s / seconds,
            "vs_ce": ce_s / seconds, "verified": row.mismatched == 0 if row.verify else None,
            "exact": ("-" if not row.verify else "yes" if row.mismatched == 0
                      else f"NO ({row.mismatched} tensors)")})
    return table, facts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-8b", choices=[*sorted(MODEL_SHAPES), "demo"],
                        help="the shape list (wtransfer.shapes)")
    parser.add_argument("--repeats", type=int, default=5, help="timed updates per row")
    parser.add_argument("--warmup", type=int, default=1, help="untimed updates per row first")
    parser.add_argument("--bucket-mb", default="64,1024",
                        help="bucket sizes of the packed wtransfer rows (64: the default)")
    parser.add_argument("--num-buffers", type=int, default=2,
                        help="staging buffers of the packed wtransfer rows (2: the default)")
    parser.add_argument("--paths", default="all",
                        help=f"comma-separated row families: {', '.join(FAMILIES)}")
    parser.add_argument("--skip-ce", action="store_true",
                        help="leave checkpoint-engine out (it need not be installed)")
    parser.add_argument("--ce-settle-s", type=float, default=1.0,
                        help="pause after each checkpoint-engine update, outside the timing")
    parser.add_argument("--verbose", action="store_true", help="checkpoint-engine's INFO logs")
    parser.add_argument("--engine-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--receivers", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--ce", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.repeats < 1 or args.warmup < 0:
        parser.error("--repeats must be at least 1 and --warmup at least 0")
    if args.engine_child:
        run_engine(args)
        return
    if not torch.cuda.is_available():
        sys.exit(NO_CUDA)
    ce_version = None
    if not args.skip_ce:
        try:
            import checkpoint_engine
        except ImportError as exc:
            sys.exit(f"checkpoint-engine is not importable ({exc}): install "
                     f"checkpoint-engine=={CE_VERSION} with pyzmq, loguru, fastapi, uvicorn and "
                     "pydantic, or pass --skip-ce")
        ce_version = checkpoint_engine.__version__
        if ce_version != CE_VERSION:
            print(f"warning: checkpoint-engine {ce_version}, not {CE_VERSION}", flush=True)
    rows, facts = bench(args)
    print(f"\n{args.model} bf16, {facts['tensors']} tensors, {facts['bytes'] / 1e9:.2f} GB, one "
          f"GPU, engine in another process; median of {args.repeats} after {args.warmup} "
          "warm-up, rows interleaved (vs floor = floor/this; x CE = checkpoint-engine update "
          "(kept group)/this)")
    print_table(rows, [("path", "path", ""), ("bucket", "MiB", ""), ("ms", "median ms", ".1f"),
                       ("gbps", "GB/s", ".1f"), ("floor", "floor", ""),
                       ("vs_floor", "vs floor", ".2f"), ("vs_ce", "x CE", ".2f"),
                       ("exact", "bit-exact", "")])
    if "ce_first_register_s" in facts:
        print(f"checkpoint-engine's first register_checkpoint (allocate and pin its pool, copy): "
              f"{facts['ce_first_register_s']:.2f} s")
    for key, chosen in facts.get("staging", {}).items():
        print(f"staging of {key}: {chosen}")
    for key, reason in facts["skipped"].items():
        print(f"skipped {key}: {reason}")
    path = write_json(f"peers-{args.model}", rows,
                      {**vars(args), **facts, "checkpoint_engine": ce_version})
    print(f"wrote {path}")
    if any(r["verified"] is False for r in rows):
        sys.exit("an update was not bit-exact")


if __name__ == "__main__":
    main()
