"""Sharded trainers as real processes: N ranks of an FSDP2 model sending together.

    python -m wtransfer.launch.trainer_ranks --rank R --ranks N --port P --backend ipc \\
        --address tcp://... [--address ...] --senders K --model mixed --seed 1

Each rank joins a gloo process group, shards the model with FSDP2 (`fully_shard`, CPU device
mesh; with --replicate, or on a GPU (--device cuda:N, every rank on it), each holds the whole
model instead, as data-parallel replicas do), gives itself a client when R < K (one
`RPCClient` per receiver address, an `HTTPClient` for an ``http://`` one, a vLLM
`ServerClient` for a ``vllm+http://`` one, fanned out), and
calls `trainer_init` and `send_weights` with every other rank. It prints one JSON line per
update: the transfer's stats, the most gathered bytes it held, and (with --fingerprint) the
fingerprint of the full model. Used by the tests, the benchmark and the demo.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Sequence
from datetime import timedelta
from typing import IO, Any

from wtransfer import wire
from wtransfer.errors import TransferTimeout
from wtransfer.transport.stacks import print_stacks_on_sigusr1


def shard(module: Any, ranks: int) -> Any:
    """Shard `module`'s parameters over `ranks` CPU ranks with FSDP2 (`fully_shard`)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (ranks,))
    layers = getattr(getattr(module, "model", None), "layers", None)
    for layer in layers.children() if layers is not None else ():
        fully_shard(layer, mesh=mesh)
    return fully_shard(module, mesh=mesh)


def _client(address: str, timeout_s: float) -> Any:
    """The client of one receiver address: ``http://`` our engine's server, ``vllm+http://``
    a ``vllm serve`` (`wtransfer_vllm.ServerClient`), else an `RPCClient` address."""
    if address.startswith("vllm+"):
        from wtransfer_vllm import ServerClient  # only where a vLLM server is the receiver

        return ServerClient(address.removeprefix("vllm+"), timeout_s=timeout_s)
    if address.startswith("http"):
        from wtransfer.control.clients import HTTPClient

        return HTTPClient(address, timeout_s=timeout_s)
    from wtransfer.control.rpc import RPCClient

    return RPCClient(address, timeout_s=timeout_s)


def run(args: argparse.Namespace) -> None:
    """One trainer rank (see the module docstring)."""
    import torch
    import torch.distributed as dist

    import wtransfer
    from wtransfer.control.clients import FanoutClient
    from wtransfer.launch.models import build
    from wtransfer.launch.processes import local_store
    from wtransfer.shapes import perturb, randomize

    dist.init_process_group("gloo", store=local_store(args.ranks, args.timeout, args.port),
                            rank=args.rank, world_size=args.ranks,
                            timeout=timedelta(seconds=args.timeout))
    module = build(args.model, args.seed, args.device)
    replicate = args.replicate or args.device != "cpu"
    model = shard(module, args.ranks) if args.ranks > 1 and not replicate else module
    client: Any = None
    if args.rank < args.senders:
        clients = [_client(a, args.timeout) for a in args.address]
        client = clients[0] if len(clients) == 1 else FanoutClient(clients)
    fields = wire.decode(bytes.fromhex(args.init_hex)) if args.init_hex else {}
    info = wtransfer.get_backend(args.backend).sender_class().init_info_cls(**fields)
    source: Any = wtransfer.ModuleSource(model)
    if args.fp8:  # the ranks quantize their shards before sending (an FP8 engine's scheme)
        from wtransfer.quant.source import Fp8Source

        source = Fp8Source(source)
    sender = wtransfer.trainer_init(  # replicas: nothing sharded says they send together
        info, client=client, source=source,
        process_group=dist.group.WORLD if replicate and args.ranks > 1 else None)
    print(json.dumps({"event": "ready", "rank": args.rank, "pid": os.getpid(),
                      "reads": str(getattr(sender, "reads", ""))}), flush=True)
    fractions = [float(f) for f in args.change_fraction.split(",")] if args.change_fraction \
        else []
    for step in range(args.updates):
        if step and args.gated:
            _wait_to_go(args.timeout)
        if step and fractions:  # a small step (replicas change alike); 0: no change
            fraction = fractions[min(step, len(fractions)) - 1]
            if fraction:
                perturb(model, fraction, 1_000_003 * args.seed + 97 * step)
        elif step and not args.same_weights:
            randomize(model, 1_000_003 * args.seed + step)
        if args.device != "cpu":  # the step's writes ran: what is timed below is the update
            torch.cuda.synchronize(args.device)
        stats = sender.send_weights(weight_version=f"sharded-{step}")
        out: dict[str, Any] = {"event": "sent", "rank": args.rank, "step": step,
                               **stats.as_dict()}
        if args.fingerprint:
            out["fingerprint"] = wtransfer.fingerprint(model.state_dict())
        if hasattr(sender, "last_update_read"):  # (ucx) how this update went
            out["read"] = sender.last_update_read
        print(json.dumps(out), flush=True)
    sender.shutdown()
    dist.destroy_process_group()
    print(json.dumps({"event": "done", "rank": args.rank}), flush=True)


def _wait_to_go(timeout_s: float) -> None:
    """Block until the launcher writes a line to stdin (`TrainerRanks.go`), within
    `timeout_s`."""
    import select

    ready, _, _ = select.select([sys.stdin], [], [], timeout_s)
    if not ready or not sys.stdin.readline():
        raise TransferTimeout(f"the launcher did not say go on within {timeout_s:g}s")


class TrainerRanks:
    """N trainer rank processes (see the module docstring); `lines(rank)` reads their reports."""

    def __init__(self, ranks: int, *, backend: str, addresses: list[str], senders: int = 1,
                 model: str = "mixed", seed: int = 1, updates: int = 1,
                 init_fields: dict[str, Any] | list[dict[str, Any]] | None = None,
                 fingerprint: bool = False,
                 timeout_s: float = 60.0, fp8: bool = False, device: str = "cpu",
                 replicate: bool = False, same_weights: bool = False,
                 change_fraction: float | Sequence[float] = 0.0, gated: bool = False
                 ) -> None:
        from wtransfer.launch.processes import local_store

        self._store = local_store(ranks, timeout_s)  # lives as long as the ranks
        port = int(self._store.port)
        self.procs = []
        self._stderr: list[IO[str]] = []
        for rank in range(ranks):
            cmd = [sys.executable, "-m", "wtransfer.launch.trainer_ranks", "--rank", str(rank),
                   "--ranks", str(ranks), "--port", str(port), "--backend", backend,
                   "--senders", str(senders), "--model", model, "--seed", str(seed),
                   "--updates", str(updates), "--timeout", str(timeout_s), "--device", device]
            for address in addresses:
                cmd += ["--address", address]
            mine = init_fields[rank] if isinstance(init_fields, list) else init_fields
            if mine:  # (a list: each rank's own)
                cmd += ["--init-hex", wire.encode(mine).hex()]
            if fingerprint:
                cmd.append("--fingerprint")
            if fp8:
                cmd.append("--fp8")
            if replicate:
                cmd.append("--replicate")
            if same_weights:
                cmd.append("--same-weights")
            if change_fraction:  # (a list: step k's fraction, the last one repeated)
                cmd += ["--change-fraction", ",".join(
                    str(f) for f in (change_fraction if isinstance(change_fraction, Sequence)
                                     else [change_fraction]))]
            if gated:
                cmd.append("--gated")
            # stderr to a file: a pipe read only at exit would stall a rank that warns a lot
            self._stderr.append(tempfile.TemporaryFile(  # noqa: SIM115 (closed in close)
                "w+", errors="replace"))
            self.procs.append(subprocess.Popen(
                cmd, stdin=subprocess.PIPE if gated else subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=self._stderr[-1], text=True,
                env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}))
        self._lines: list[list[dict[str, Any]]] = [[] for _ in range(ranks)]
        self._readers = [threading.Thread(target=self._read, args=(r,), daemon=True)
                         for r in range(ranks)]
        for thread in self._readers:
            thread.start()

    def _read(self, rank: int) -> None:
        stdout = self.procs[rank].stdout
        assert stdout is not None
        for line in stdout:
            if line.startswith("{"):
                self._lines[rank].append(json.loads(line))

    def wait_for(self, rank: int, event: str, timeout_s: float, count: int = 1
                 ) -> dict[str, Any]:
        """The `count`-th report `event` of `rank`, within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while True:
            seen = [line for line in self._lines[rank] if line["event"] == event]
            if len(seen) >= count:
                return seen[count - 1]
            if self.procs[rank].poll() is not None and not self._readers[rank].is_alive():
                raise RuntimeError(f"trainer rank {rank} exited with "
                                   f"{self.procs[rank].returncode}: {self.stderr(rank)[-3000:]}")
            if time.monotonic() > deadline:
                raise TransferTimeout(f"trainer rank {rank} did not report {event!r} within "
                                      f"{timeout_s:g}s")
            time.sleep(0.01)

    def go(self) -> None:
        """Let gated ranks (`gated=True`) make their next update."""
        for proc in self.procs:
            assert proc.stdin is not None, "TrainerRanks(gated=True) takes go()"
            proc.stdin.write("go\n")
            proc.stdin.flush()

    def reports(self, rank: int, event: str) -> list[dict[str, Any]]:
        """Every report `event` of `rank` so far."""
        return [line for line in self._lines[rank] if line["event"] == event]

    def stderr(self, rank: int) -> str:
        """What `rank` wrote to stderr so far."""
        self._stderr[rank].seek(0)
        return self._stderr[rank].read()

    def wait(self, timeout_s: float) -> list[int]:
        """Every rank's exit code, within `timeout_s` (then they are killed)."""
        deadline = time.monotonic() + timeout_s
        codes = []
        for proc in self.procs:
            try:
                codes.append(proc.wait(max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                proc.kill()
                codes.append(proc.wait())
        return codes

    def close(self) -> None:
        """Kill what still runs."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for file in self._stderr:
            file.close()

    def __enter__(self) -> TrainerRanks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def main(argv: list[str] | None = None) -> None:
    """Entry point of one rank."""
    print_stacks_on_sigusr1()
    parser = argparse.ArgumentParser(prog="python -m wtransfer.launch.trainer_ranks")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--ranks", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--backend", default="ipc")
    parser.add_argument("--address", action="append", default=[])
    parser.add_argument("--senders", type=int, default=1)
    parser.add_argument("--model", default="mixed")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--updates", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--init-hex", default="")
    parser.add_argument("--fingerprint", action="store_true")
    parser.add_argument("--fp8", action="store_true",
                        help="send through Fp8Source (quantized on the ranks)")
    parser.add_argument("--device", default="cpu",
                        help="where the model lives; a GPU implies --replicate")
    parser.add_argument("--replicate", action="store_true",
                        help="every rank holds the whole model (no FSDP2)")
    parser.add_argument("--same-weights", action="store_true",
                        help="every update sends the same weights (else new random ones)")
    parser.add_argument("--gated", action="store_true",
                        help="before each update after the first, wait for a line on stdin")
    parser.add_argument("--change-fraction", default="",
                        help="between updates flip a bit of this fraction of each rank's "
                             "elements (else new random weights); a comma-separated list "
                             "gives each step's (the last repeated; 0: unchanged)")
    try:
        run(parser.parse_args(argv))
    except Exception:  # a rank that fails (its sender refused at connect, say) prints
        traceback.print_exc()  # its error, tears its group down and exits 1 at once: left
        try:  # to the interpreter's exit, a C++ thread still joinable there sometimes
            _destroy_group()  # aborted the process ("terminate called without an active
        finally:  # exception") instead of letting it exit with the error
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)
    _destroy_group()


def _destroy_group() -> None:
    """Tear the rank's process group down, where one is up."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
