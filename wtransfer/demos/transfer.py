"""`wtransfer demo`: a trainer pushes a transformer's weights into an engine-side process.

Both processes build the same Qwen3-style decoder from different seeds; the trainer (this
process) sends its weights several times through the chosen backend, showing progress, then
proves with per-tensor fingerprints that the engine holds exactly the trainer's weights.
"""

from __future__ import annotations

import statistics
import sys

from wtransfer.control.rpc import RPCClient
from wtransfer.fingerprint import fingerprint
from wtransfer.launch.models import build
from wtransfer.launch.processes import spawn_receiver
from wtransfer.registry import get_backend, trainer_init
from wtransfer.shapes import model_metas, randomize
from wtransfer.trainer.source import ModuleSource

BAR = 30


def _bar(done: int, total: int, note: str) -> None:
    """A live progress line on a terminal; one plain line per finished step in a log."""
    filled = BAR * done // total
    line = f"  [{'#' * filled}{'.' * (BAR - filled)}] {done}/{total} {note}"
    if sys.stdout.isatty():
        sys.stdout.write(f"\r{line:<90}")
        sys.stdout.flush()
    elif not note.endswith("..."):
        print(line)


def run_demo(*, backend: str = "ipc", model: str = "demo", rounds: int = 5, bucket_mb: int = 32,
             checksum: bool = False) -> int:
    """Run the demo; returns the process exit code (0 when every check passed)."""
    metas = model_metas(model)
    total = sum(m.nbytes for m in metas)
    print(f"wtransfer demo: backend={backend}  model={model} ({len(metas)} tensors, "
          f"{total / 1e6:.1f} MB)  bucket={bucket_mb} MiB  rounds={rounds}")
    print("  starting the engine-side process (its own copy of the model, other weights) ...")
    with spawn_receiver(backend, model=model, seed=2) as engine:
        print(f"  engine process pid {engine.info['pid']} serving at {engine.address}")
        trainer_model = build(model, seed=1, device="cpu")
        client = RPCClient(engine.address, timeout_s=60)
        before = client.fingerprint() == fingerprint(trainer_model.state_dict())
        print(f"  fingerprints before transfer: {'EQUAL (unexpected!)' if before else 'different'}")
        info = get_backend(backend).sender_class().init_info_cls(
            bucket_bytes=bucket_mb << 20, checksum=checksum)
        stats = []
        with trainer_init(info, client=client, source=ModuleSource(trainer_model)) as sender:
            for step in range(rounds):
                if step:  # a training step changed the weights
                    randomize(trainer_model, seed=1000 + step)
                _bar(step, rounds, "sending ...")
                stats.append(sender.send_weights(weight_version=f"step-{step}"))
                s = stats[-1]
                _bar(step + 1, rounds, f"step-{step}: {s.seconds * 1e3:7.1f} ms  "
                                       f"{s.gbps:5.2f} GB/s")
            if sys.stdout.isatty():
                print()
        after = client.fingerprint() == fingerprint(trainer_model.state_dict())
        version = client.status()["weight_version"]
    last = stats[-1]
    median_s = statistics.median(s.seconds for s in stats)
    print()
    print(f"  {'bytes':>14} {'tensors':>8} {'buckets':>8} {'median ms':>10} {'GB/s':>7}")
    print(f"  {last.bytes:>14,} {last.tensors:>8} {last.buckets:>8} {median_s * 1e3:>10.1f} "
          f"{last.bytes / median_s / 1e9:>7.2f}")
    print(f"  engine weight version: {version}")
    verdict = "EQUAL - every tensor is bit-exact" if after else "DIFFERENT"
    print(f"  fingerprints after transfer:  {verdict}")
    ok = after and not before and version == f"step-{rounds - 1}"
    print("demo " + ("passed" if ok else "FAILED"))
    return 0 if ok else 1
