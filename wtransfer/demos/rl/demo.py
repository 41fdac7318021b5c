"""`wtransfer demo`: an async-RL run on one machine, with weights flowing mid-flight.

The trainer (this process) improves a tiny decoder with a GRPO-style objective on a verifiable
task while an inference server (`wtransfer serve --dev-mode` in a child process, or an
in-process engine with --local) keeps generating. Generation of step k+1 overlaps training on
step k; after each step the trainer sends the weights (`weight_version=f"step-{k}"`): staged
while the engine generates, or in place with the server paused (keep) around it. With
`lora=True` the policy is a trained LoRA adapter on a frozen base and only the adapter moves
(`wtransfer.demos.rl.lora`). At the end two checks decide the exit code: mid-flight keep
requests (clear_cache, batch-invariant) must match a fresh engine holding the final weights
token for token, and the server must hold the trainer's weights bit for bit (fingerprints).
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from wtransfer.demos.rl.grpo import Rollout
from wtransfer.demos.rl.lora import ADAPTER, LORA_RANK, LoRATrainer
from wtransfer.demos.rl.servers import HTTPPolicyServer, LocalPolicyServer, Stream
from wtransfer.demos.rl.task import ChainParityTask
from wtransfer.demos.rl.trainers import LocalTrainer, ShardedTrainer
from wtransfer.errors import ConfigError
from wtransfer.inference import MODEL_CONFIGS
from wtransfer.registry import get_backend, list_backends

MODEL = "tiny"
VLLM_MODEL = "tiny32"
"""vLLM's CPU attention needs head_dim >= 32."""
VALIDATION_TOKENS = 192
"""Long enough that a validation request seen running before the last pause is still running
when the pause lands, even on a loaded machine (a step of the tiny model takes milliseconds)."""


@dataclass
class StepRecord:
    """What one RL step did."""

    step: int
    reward: float
    transfer_ms: float
    gbps: float
    moved_kib: float
    """Tensor bytes the update moved (the adapter alone with LoRA, the changes with deltas),
    in KiB."""
    changed: float | None
    """With deltas: the fraction of elements that changed (None: a full update)."""
    paused_ms: float | None
    """The pause around the update, as the trainer saw it (None: a staged update, no pause)."""
    stall_ms: float | None
    """The longest time the update kept the engine from computing, between two steps (None:
    not measured)."""
    inflight: int
    straddled: int
    train_ms: float
    version: str
    """The server's weight version after the step's update."""


def _init_info(backend: str, workers: int, delta: bool) -> Any:
    cls = get_backend(backend).sender_class().init_info_cls
    if backend == "nccl":
        return cls(master_address="127.0.0.1", world_size=1 + workers,
                   bucket_bytes=1 << 20, delta=delta)
    return cls(bucket_bytes=1 << 20, delta=delta)


def _rollouts(prompts: list[list[int]], choices: list[dict[str, Any]], group: int,
              task: ChainParityTask) -> list[Rollout]:
    out = []
    for i, choice in enumerate(choices):
        prompt = prompts[i // group]
        out.append(Rollout(prompt, choice["token_ids"], choice["logprobs"],
                           [(v["version"], v["start"], v["end"])
                            for v in choice["weight_versions"]],
                           task.reward(prompt, choice["token_ids"])))
    return out


def _median(values: Iterable[float | None]) -> float | None:
    """The median of the measured values (None when none was measured)."""
    measured = [v for v in values if v is not None]
    return statistics.median(measured) if measured else None


def _ms(value: float | None, width: int) -> str:
    return f"{value:>{width}.2f}" if value is not None else f"{'-':>{width}}"


def _print_row(r: StepRecord) -> None:
    print(f"{r.step:>5} {r.reward:>7.3f} {r.transfer_ms:>12.2f} {r.gbps:>7.3f} "
          f"{r.moved_kib:>10.1f} "
          f"{f'{r.changed:.1%}' if r.changed is not None else '-':>8} "
          f"{_ms(r.paused_ms, 10)} {_ms(r.stall_ms, 9)} {r.inflight:>9} {r.straddled:>10} "
          f"{r.train_ms:>9.1f}",
          flush=True)


def _check_options(*, backend: str, **counts: int) -> None:
    """`ConfigError` saying what to change for a count below 1 or a backend that cannot run
    here, before anything starts."""
    for name, value in counts.items():
        if value < 1:
            raise ConfigError(f"{name.replace('_', '-')} must be at least 1, got {value}")
    info = list_backends().get(backend)
    if info is None:
        raise ConfigError(f"unknown backend {backend!r}; known: {sorted(list_backends())}")
    if not info.available:
        raise ConfigError(f"backend {backend!r} cannot run here: {info.reason}")


def _check_lora(*, engine: str, ray_engines: int, trainer_ranks: int,
                tensor_parallel_size: int, update_staging: str) -> None:
    """`ConfigError` for a --lora run this demo cannot make, before anything starts."""
    if engine != "wtransfer" or ray_engines:
        raise ConfigError("--lora runs with our engine (drop --engine vllm / --ray); vLLM "
                          "takes adapters in memory through wtransfer_vllm.lora (docs/lora.md)")
    if trainer_ranks > 1 or tensor_parallel_size > 1:
        raise ConfigError("--lora trains in one process and serves unsharded: drop "
                          "--trainer-ranks / --tensor-parallel-size")
    if update_staging == "off":
        raise ConfigError("--lora needs staged updates (an adapter lands in the shadow): "
                          "drop --update-staging off")


def _holds(served: dict[str, str], expected: dict[str, str]) -> bool:
    """Whether the engine's fingerprint holds every expected tensor bit for bit."""
    return all(served.get(name) == digest for name, digest in expected.items())


def _policy_server(engine: str, local: bool, model: str, backend: str,
                   data_parallel_size: int, ray_engines: int = 0,
                   ray_address: str | None = None, update_staging: str = "auto",
                   tensor_parallel_size: int = 1, max_loras: int = 0,
                   log_path: Path | None = None, fleet: int = 1, pd: bool = False) -> Any:
    """The server the demo generates from (and prints which)."""
    if ray_engines:
        from wtransfer.demos.rl.ray_server import RayPolicyServer

        print(f"wtransfer demo: async GRPO on chain-parity, backend={backend}, server="
              f"{ray_engines} engine actor(s) on Ray ({ray_address or 'a local cluster'})")
        return RayPolicyServer(model=model, seed=0, backend=backend, engines=ray_engines,
                               address=ray_address)
    dp = f", {data_parallel_size} data-parallel ranks" if data_parallel_size > 1 else ""
    if tensor_parallel_size > 1:
        dp += f", {tensor_parallel_size} tensor-parallel workers each"
    if engine == "vllm":
        from wtransfer.demos.rl.vllm_server import VLLMPolicyServer

        print(f"wtransfer demo: async GRPO on chain-parity, backend={backend}, server=vLLM "
              f"AsyncLLM (in process){dp}")
        return VLLMPolicyServer(model=model, seed=0, backend=backend,
                                data_parallel_size=data_parallel_size)
    if engine != "wtransfer":
        raise ConfigError(f"engine must be 'wtransfer' or 'vllm', got {engine!r}")
    if pd:
        from wtransfer.demos.rl.fleet import PDPolicyServer

        print(f"wtransfer demo: async GRPO on chain-parity, backend={backend}, server=a prefill "
              "and a decode wtransfer serve instance (P/D), updated as one")
        assert log_path is not None
        return PDPolicyServer(log_dir=log_path.parent, model=model, seed=0, backend=backend,
                              update_staging=update_staging)
    if fleet > 1:
        from wtransfer.demos.rl.fleet import FleetPolicyServer

        print(f"wtransfer demo: async GRPO on chain-parity, backend={backend}, server=a fleet "
              f"of {fleet} wtransfer serve instances behind a round-robin balancer (one killed "
              "and replaced mid-run)")
        assert log_path is not None
        return FleetPolicyServer(engines=fleet, log_dir=log_path.parent, model=model, seed=0,
                                 backend=backend, update_staging=update_staging)
    where = "in-process engine" if local else "wtransfer serve (child process, HTTP)"
    print(f"wtransfer demo: async GRPO on chain-parity, backend={backend}, server={where}{dp}")
    if local:
        return LocalPolicyServer(model=model, seed=0, backend=backend,
                                 data_parallel_size=data_parallel_size,
                                 update_staging=update_staging,
                                 tensor_parallel_size=tensor_parallel_size,
                                 max_loras=max_loras, max_lora_rank=LORA_RANK)
    print(f"  the server's log: {log_path}")
    return HTTPPolicyServer(model=model, seed=0, backend=backend,
                            data_parallel_size=data_parallel_size,
                            update_staging=update_staging,
                            tensor_parallel_size=tensor_parallel_size, max_loras=max_loras,
                            max_lora_rank=LORA_RANK, log_path=log_path)


def _validate(server: Any, trainer: Any, streams: list[tuple[list[int], Stream]],
              version: Callable[[], str]) -> tuple[bool, list[str]]:
    """Post-pause tokens of the mid-flight requests against an engine holding the final
    weights (`trainer.reference`: the base plus the adapter for a LoRA trainer); then
    fingerprints."""
    problems: list[str] = []
    reference = trainer.reference(server)
    checked = 0
    for prompt, handle in streams:
        choice = handle.result.result(timeout=120)
        spans = choice["weight_versions"]
        if len(spans) == 1 and spans[0]["end"] == VALIDATION_TOKENS and \
                spans[0]["version"] != version():
            continue  # it finished before the pause landed: nothing straddled, nothing to check
        if len(spans) != 2:
            problems.append(f"expected 2 weight-version spans, got {spans}")
            continue
        pre = spans[0]["end"]
        tokens = choice["token_ids"]
        want = reference(prompt + tokens[:pre], VALIDATION_TOKENS - pre)
        if want != tokens[pre:]:
            problems.append(f"post-pause tokens {tokens[pre:]} != fresh engine {want}")
        checked += 1
    reference.close()
    if not checked:
        problems.append("no validation request was still running when the last pause landed")
    if not _holds(server.client.fingerprint(), trainer.expected_fingerprint()):
        problems.append("trainer and server fingerprints differ")
    print(f"  mid-flight keep requests checked against a fresh engine: {checked}, "
          f"mismatches: {sum('post-pause' in p for p in problems)}")
    return not problems, problems


def _plot(records: list[StepRecord], path: Path, title: str) -> None:
    """Reward and update times per step, under `title` (backend and outcome); the legends sit
    below the axes so they never hide a point."""
    try:
        import matplotlib
    except ImportError:
        print("  (no plot: pip install -e '.[demo]' for matplotlib)")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4.2))
    fig.suptitle(title)
    steps = [r.step for r in records]
    ax1.plot(steps, [r.reward for r in records], marker="o", color="tab:green")
    ax1.set(xlabel="step", ylabel="mean reward", title="reward per step", ylim=(0, 1.05))
    ax1.axhline(0.5, color="grey", linestyle=":", label="random policy")
    ax1.legend(loc="upper center", bbox_to_anchor=(0.5, -0.18), frameon=False)
    ax2.bar(steps, [r.transfer_ms for r in records], color="tab:blue", label="transfer")
    for key, label, color in (("paused_ms", "paused (pause+transfer+resume)", "tab:orange"),
                              ("stall_ms", "engine stall (no step computed)",
                               "tab:red")):
        points = [(r.step, getattr(r, key)) for r in records if getattr(r, key) is not None]
        if points:
            ax2.plot(*zip(*points, strict=True), color=color, marker=".", label=label)
    ax2.set(xlabel="step", ylabel="ms", title="weight update time per step")
    ax2.legend(loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=3, frameon=False,
               fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_rl_demo(*, steps: int = 40, backend: str = "ipc", local: bool = False,
                prompts_per_step: int = 8, group: int = 8, max_tokens: int = 8,
                lr: float = 1e-2, seed: int = 0, run_dir: str | None = None,
                data_parallel_size: int = 1, engine: str = "wtransfer",
                trainer_ranks: int = 1, ray_engines: int = 0,
                ray_address: str | None = None, update_staging: str = "auto",
                tensor_parallel_size: int = 1, lora: bool = False, delta: bool = False,
                fleet: int = 1, pd: bool = False) -> int:
    """Run the demo; returns the exit code (0 when both validations passed). `engine`: "wtransfer"
    or "vllm"; `trainer_ranks` > 1 trains with FSDP2 ranks; `ray_engines` > 0 serves from Ray
    actors (`ray_address`, else a local cluster); `lora` sends an adapter, `delta` changed elements;
    `fleet` > 1 serves from that many `wtransfer serve` instances, one replaced mid-run."""
    if (fleet > 1 or pd) and (local or engine != "wtransfer" or ray_engines or lora
                      or data_parallel_size > 1 or tensor_parallel_size > 1
                      or trainer_ranks > 1):
        raise ConfigError("--engines N (a fleet) and --pd run wtransfer serve instances of one "
                          "worker each, trained by one rank: drop --local, --engine vllm, "
                          "--lora, --data/--tensor-parallel-size and --trainer-ranks")
    if fleet > 1 and pd:
        raise ConfigError("--engines N and --pd: choose one")
    _check_options(steps=steps, backend=backend, data_parallel_size=data_parallel_size,
                   tensor_parallel_size=tensor_parallel_size,
                   trainer_ranks=trainer_ranks, prompts_per_step=prompts_per_step, group=group)
    if lora:
        _check_lora(engine=engine, ray_engines=ray_engines, trainer_ranks=trainer_ranks,
                    tensor_parallel_size=tensor_parallel_size, update_staging=update_staging)
    if delta and trainer_ranks > 1:
        raise ConfigError("--delta sends from one unsharded trainer: drop --trainer-ranks "
                          "(deltas from FSDP2 shards are not supported yet)")
    torch.manual_seed(seed)
    rng = random.Random(seed)
    started = time.perf_counter()
    out_dir = Path(run_dir or f"runs/rl-{time.strftime('%Y%m%d-%H%M%S')}")
    out_dir.mkdir(parents=True, exist_ok=True)
    model = VLLM_MODEL if engine == "vllm" else MODEL
    server = _policy_server(engine, local, model, backend, data_parallel_size, ray_engines,
                            ray_address, update_staging, tensor_parallel_size,
                            max_loras=1 if lora else 0, log_path=out_dir / "server.log",
                            fleet=fleet, pd=pd)
    try:
        if ray_engines:  # addresses as Ray sees this node; one worker per engine actor
            from wtransfer.ray import trainer_init_info

            info = trainer_init_info(backend, server.client, bucket_bytes=1 << 20, delta=delta)
        else:
            info = _init_info(backend, data_parallel_size * tensor_parallel_size, delta)
        trainer = (LoRATrainer(model, lr, info, server.client) if lora else
                   LocalTrainer(model, lr, info, server.client) if trainer_ranks == 1 else
                   ShardedTrainer(model, lr, info, server.client, ranks=trainer_ranks,
                                  backend=backend))
        if trainer_ranks > 1:
            print(f"  the policy is trained by {trainer_ranks} FSDP2 ranks (gloo); rank 0 "
                  "sends, every rank gathers bucket by bucket")
        sample: dict[str, Any] = {"max_tokens": max_tokens, "temperature": 1.0}
        version: Callable[[], str] = server.weight_version
        if isinstance(trainer, LoRATrainer):
            first = trainer.send("lora-init")  # B is zero: the base model's tokens
            whole = sum(t.numel() * t.element_size() for t in trainer.base_state().values())
            print(f"  LoRA: a rank-{LORA_RANK} adapter {ADAPTER!r} on {trainer.projections} "
                  f"projections is trained and only it moves: {first.bytes / 1024:.1f} KiB "
                  f"per update (the model: {whole / 1024:.0f} KiB)")
            sample["lora"] = ADAPTER

            def version() -> str:  # the adapter's label (the base keeps its own)
                return str(server.weight_info()["adapters"][ADAPTER])
        task = ChainParityTask(MODEL_CONFIGS[model].vocab_size)
        if not _holds(server.client.fingerprint(), trainer.expected_fingerprint()):
            raise RuntimeError("trainer and server do not start from the same policy")

        def submit() -> tuple[list[list[int]], list[Any]]:
            prompts = task.prompts(prompts_per_step, rng)
            futures = [server.generate([p], {**sample, "seed": rng.randrange(1 << 31)})[0]
                       for p in prompts for _ in range(group)]
            return prompts, futures

        staged = server.staging != "off"
        print("  updates: " + (f"staged ({server.staging}): no pause, the engine commits at "
                               "a step boundary" if staged
                               else "in place, the engine paused (keep) around each"))
        print(f"{'step':>5} {'reward':>7} {'transfer ms':>12} {'GB/s':>7} {'moved KiB':>10} "
              f"{'changed':>8} "
              f"{'paused ms':>10} "
              f"{'stall ms':>9} {'in-flight':>9} {'straddled':>10} {'train ms':>9}")
        records: list[StepRecord] = []
        streams: list[tuple[list[int], Stream]] = []
        pending = submit()
        for step in range(steps):
            prompts, futures = pending
            choices = [f.result(timeout=300) for f in futures]
            pending = submit()  # generation of step k+1 overlaps training on step k
            rollouts = _rollouts(prompts, choices, group, task)
            t0 = time.perf_counter()
            trainer.step(rollouts, group)
            train_ms = (time.perf_counter() - t0) * 1e3
            if step == steps - 1:  # mid-flight validation requests straddle the last update
                greedy = {"max_tokens": VALIDATION_TOKENS, "temperature": 0.0,
                          **({"lora": ADAPTER} if lora else {})}
                streams = [(p, server.stream(p, greedy)) for p in task.prompts(6, rng)]
                deadline = time.monotonic() + 120
                while any(h.tokens < 3 for _, h in streams):
                    if time.monotonic() > deadline:
                        raise RuntimeError("validation requests made no progress")
                    time.sleep(0.002)
            inflight = server.inflight()
            paused_ms: float | None = None
            if staged:  # the engine keeps generating; the commit re-prefills in-flight requests
                stats = trainer.send(f"step-{step}")
            else:
                t0 = time.perf_counter()
                server.pause("keep", clear_cache=True)
                stats = trainer.send(f"step-{step}")
                server.resume()
                paused_ms = (time.perf_counter() - t0) * 1e3
            straddled = sum(len(r.versions) > 1 for r in rollouts)
            moved = stats.wire_bytes if stats.wire_bytes is not None else stats.bytes
            if fleet > 1 and step == steps // 2:  # one instance dies, a new one joins
                server.churn()
                for event in server.events:
                    print(f"  fleet: {event}")
            if fleet > 1 and (stats.dropped or step == steps // 2 + 1):
                print(f"  {server.client.summary(version(), stats.dropped or [])}")
            record = StepRecord(step, statistics.fmean(r.reward for r in rollouts),
                                stats.seconds * 1e3, stats.gbps, moved / 1024,
                                stats.changed_fraction, paused_ms,
                                server.stall_ms(), inflight, straddled, train_ms, version())
            records.append(record)
            _print_row(record)
        for f in pending[1]:
            f.result(timeout=300)
        if pd:
            remote, local = server.prefilled()
            print(f"  P/D: {remote} request(s) decoded from the prefill instance's K/V, "
                  f"{local} prefilled on the decode instance (another weight version, or its "
                  "re-prefills at commits)")
        ok, problems = _validate(server, trainer, streams, version)
        trainer.close()
    finally:
        server.close()
    return _report(records, ok, problems, out_dir, time.perf_counter() - started, backend)


def _report(records: list[StepRecord], ok: bool, problems: list[str], out_dir: Path,
            wall_s: float, backend: str) -> int:
    head = statistics.fmean(r.reward for r in records[:5])
    tail = statistics.fmean(r.reward for r in records[-5:])
    summary = {
        "steps": len(records), "reward_first5": head, "reward_last5": tail,
        "median_transfer_ms": statistics.median(r.transfer_ms for r in records),
        "median_gbps": statistics.median(r.gbps for r in records),
        "median_paused_ms": _median(r.paused_ms for r in records),
        "median_stall_ms": _median(r.stall_ms for r in records),
        "median_moved_kib": statistics.median(r.moved_kib for r in records),
        "median_changed": _median(r.changed for r in records),
        "straddled_rollouts": sum(r.straddled for r in records),
        "wall_s": wall_s, "validation_passed": ok, "problems": problems,
    }
    (out_dir / "metrics.json").write_text(json.dumps(
        {"summary": summary, "steps": [asdict(r) for r in records]}, indent=2))
    _plot(records, out_dir / "rl.png",
          f"wtransfer demo: backend={backend}, reward {head:.2f} -> {tail:.2f}, validation "
          f"{'PASSED' if ok else 'FAILED'}")
    print()
    print("  summary")
    print(f"  {'reward, first 5 steps':<34} {head:.3f}")
    print(f"  {'reward, last 5 steps':<34} {tail:.3f}")
    print(f"  {'median transfer ms / GB/s':<34} {summary['median_transfer_ms']:.2f} / "
          f"{summary['median_gbps']:.3f}")
    paused, stall = _median(r.paused_ms for r in records), _median(r.stall_ms for r in records)
    print(f"  {'median paused ms / stall ms':<34} {_ms(paused, 0)} / {_ms(stall, 0)}")
    changed = summary["median_changed"]
    print(f"  {'median KiB moved per update':<34} {summary['median_moved_kib']:.1f}"
          + (f" ({changed:.1%} of the elements changed)" if changed is not None else ""))
    print(f"  {'rollouts that straddled an update':<34} {summary['straddled_rollouts']}")
    print(f"  {'wall time':<34} {wall_s:.1f} s")
    print(f"  {'validation':<34} {'PASSED' if ok else 'FAILED: ' + '; '.join(problems[:3])}")
    print(f"  run directory: {out_dir}  (rl.png, metrics.json)")
    sys.stdout.flush()
    return 0 if ok else 1
