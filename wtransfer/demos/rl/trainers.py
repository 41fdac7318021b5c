"""The demo's trainer: the policy trained in this process, or by N FSDP2 ranks.

`LocalTrainer` holds the policy here. `ShardedTrainer` makes this process rank 0 of N gloo
ranks (the others run `python -m wtransfer.demos.rl.trainers`, driven by commands broadcast
from rank 0 as msgpack records): the policy is sharded with FSDP2, each rank trains on its
share of the prompt groups (gradients averaged by FSDP), and every rank sends the weights
together through wtransfer, rank 0 holding the client (gathered bucket by bucket).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import warnings
from datetime import timedelta
from typing import Any

import torch

from wtransfer import wire
from wtransfer.demos.rl.grpo import Rollout, grpo_step
from wtransfer.fingerprint import fingerprint
from wtransfer.inference import load_model
from wtransfer.launch.processes import local_store
from wtransfer.packing import is_dtensor
from wtransfer.protocol import WeightSyncClient
from wtransfer.records import TransferStats
from wtransfer.registry import get_backend, trainer_init
from wtransfer.trainer.source import ModuleSource, WeightSource

TIMEOUT_S = 300.0


class LocalTrainer:
    """The policy, its optimizer and its sender, in this process."""

    def __init__(self, model: str, lr: float, info: Any, client: WeightSyncClient | None
                 ) -> None:
        self.model = self._policy(model)
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad], lr=lr)
        self.sender = trainer_init(info, client=client, source=self._source())

    def _policy(self, model: str) -> Any:
        return load_model(model, seed=0)

    def _source(self) -> WeightSource:
        return ModuleSource(self.model)

    def step(self, rollouts: list[Rollout], group: int) -> None:
        """One GRPO step on `rollouts` (`group` per prompt)."""
        grpo_step(self.model, self.optimizer, rollouts, group)

    def send(self, version: str) -> TransferStats:
        """Push the weights to the server."""
        return self.sender.send_weights(weight_version=version)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The full weights (for validation)."""
        return {k: v.detach() for k, v in self.model.state_dict().items()}

    def expected_fingerprint(self) -> dict[str, str]:
        """What the engine's fingerprint holds when it serves exactly this policy."""
        return fingerprint(self.state_dict())

    def reference(self, server: Any) -> Any:
        """The fresh engine `server` offers for greedy continuations of this policy."""
        return server.reference(self.state_dict())

    def close(self) -> None:
        """Release the sender."""
        self.sender.shutdown()


def shard_policy(model: Any, ranks: int) -> Any:
    """FSDP2 over `ranks` CPU ranks: each decoder layer, then the root; `sequence_logits` (the
    training forward) gathers like `forward` does."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    # sequence_logits returns per-sequence views of one logits tensor; nothing modifies them
    # in place, which is what FSDP2 warns about
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    mesh = init_device_mesh("cpu", (ranks,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    register_fsdp_forward_method(model, "sequence_logits")
    return model


def _rollout_to_wire(r: Rollout) -> list[Any]:
    return [r.prompt, r.tokens, r.logprobs, [list(v) for v in r.versions], r.reward]


def _rollout_from_wire(item: list[Any]) -> Rollout:
    prompt, tokens, logprobs, versions, reward = item
    return Rollout(prompt, tokens, logprobs, [tuple(v) for v in versions], reward)


class ShardedTrainer(LocalTrainer):
    """This process is rank 0 of `ranks` FSDP2 trainer ranks (see the module docstring)."""

    def __init__(self, model: str, lr: float, info: Any, client: WeightSyncClient | None, *,
                 ranks: int, backend: str) -> None:
        import torch.distributed as dist

        from wtransfer.wire import record_to_wire

        self.ranks = ranks
        store = local_store(ranks, TIMEOUT_S)
        port = int(store.port)
        self.helpers = [subprocess.Popen(
            [sys.executable, "-m", "wtransfer.demos.rl.trainers", "--rank", str(rank),
             "--ranks", str(ranks), "--port", str(port), "--model", model, "--lr", str(lr),
             "--backend", backend, "--info-hex", wire.encode(record_to_wire(info)).hex()],
            env={**os.environ, "OMP_NUM_THREADS": "1"}) for rank in range(1, ranks)]
        dist.init_process_group("gloo", store=store, rank=0, world_size=ranks,
                                timeout=timedelta(seconds=TIMEOUT_S))
        super().__init__(model, lr, info, client)

    def _policy(self, model: str) -> Any:
        return shard_policy(load_model(model, seed=0), self.ranks)

    def _command(self, record: dict[str, Any]) -> None:
        from wtransfer.trainer.group import broadcast_record

        broadcast_record(record)

    def step(self, rollouts: list[Rollout], group: int) -> None:
        """Every rank trains on its share of the prompt groups."""
        self._command({"op": "step", "group": group,
                       "rollouts": [_rollout_to_wire(r) for r in rollouts]})
        train_share(self.model, self.optimizer, rollouts, group, 0, self.ranks)

    def send(self, version: str) -> TransferStats:
        """Every rank sends together (rank 0 holds the client)."""
        self._command({"op": "send", "version": version})
        return super().send(version)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The full weights, gathered from every rank."""
        self._command({"op": "state"})
        return full_state(self.model)

    def close(self) -> None:
        """Stop the helper ranks and the process group."""
        import torch.distributed as dist

        self._command({"op": "stop"})
        super().close()
        dist.destroy_process_group()
        for helper in self.helpers:
            try:
                helper.wait(60)
            except subprocess.TimeoutExpired:
                helper.kill()


def train_share(model: Any, optimizer: Any, rollouts: list[Rollout], group: int, rank: int,
                ranks: int) -> None:
    """GRPO on this rank's prompt groups (every `ranks`-th, from `rank`)."""
    groups = [rollouts[i:i + group] for i in range(0, len(rollouts), group)]
    mine = [r for g in groups[rank::ranks] for r in g]
    grpo_step(model, optimizer, mine, group)


def full_state(model: Any) -> dict[str, torch.Tensor]:
    """Every tensor of `model` as a full tensor (a collective for DTensors)."""
    return {k: (v.full_tensor() if is_dtensor(v) else v).detach()
            for k, v in model.state_dict().items()}


def helper_main(argv: list[str] | None = None) -> None:
    """A helper trainer rank: follow rank 0's commands until "stop"."""
    import torch.distributed as dist

    from wtransfer.trainer.group import broadcast_record

    parser = argparse.ArgumentParser(prog="python -m wtransfer.demos.rl.trainers")
    for flag in ("--rank", "--ranks", "--port"):
        parser.add_argument(flag, type=int, required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--lr", type=float, required=True)
    parser.add_argument("--backend", required=True)
    parser.add_argument("--info-hex", required=True)
    args = parser.parse_args(argv)
    dist.init_process_group("gloo", store=local_store(args.ranks, TIMEOUT_S, args.port),
                            rank=args.rank, world_size=args.ranks,
                            timeout=timedelta(seconds=TIMEOUT_S))
    model = shard_policy(load_model(args.model, seed=0), args.ranks)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    info = get_backend(args.backend).sender_class().init_info_cls(
        **wire.decode(bytes.fromhex(args.info_hex)))
    sender = trainer_init(info, client=None, source=ModuleSource(model))
    while True:
        command = broadcast_record(None)
        if command["op"] == "step":
            rollouts = [_rollout_from_wire(r) for r in command["rollouts"]]
            train_share(model, optimizer, rollouts, command["group"], args.rank, args.ranks)
        elif command["op"] == "send":
            sender.send_weights(weight_version=command["version"])
        elif command["op"] == "state":
            full_state(model)
        else:
            break
    sender.shutdown()
    dist.destroy_process_group()


if __name__ == "__main__":
    helper_main()
