"""`wtransfer demo --lora`: the policy is the frozen base model plus a trained LoRA adapter,
and only the adapter moves (`wtransfer.trainer.lora.LoRASource`) into an engine that serves
it unmerged (`EngineConfig(max_loras=1)`).

The trainer's projections are `TrainableLoRA` layers in PEFT's naming (``<module>.lora_A
.weight`` [r, in], ``<module>.lora_B.weight`` [out, r], B zero at the start so the first
adapter equals the base model); the fresh engine the demo validates against receives the same
adapter the same way.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from wtransfer.demos.rl.servers import FreshEngineReference
from wtransfer.demos.rl.trainers import LocalTrainer
from wtransfer.fingerprint import fingerprint
from wtransfer.inference import AsyncEngine, EngineConfig, LocalEngineClient
from wtransfer.inference.model.decoder import load_model
from wtransfer.inference.model.lora_layers import TARGET_MODULES
from wtransfer.registry import get_backend, trainer_init
from wtransfer.trainer.lora import LoRASource
from wtransfer.trainer.source import WeightSource

ADAPTER = "policy"
"""The adapter's name on the engine (requests name it in `sampling_params.lora`)."""
LORA_RANK = 8
LORA_ALPHA = 16.0


class TrainableLoRA(nn.Linear):
    """A frozen bias-free projection plus a trained low-rank update: W x + alpha/r B (A x)."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float,
                 generator: torch.Generator) -> None:
        super().__init__(base.in_features, base.out_features, bias=False,
                         dtype=base.weight.dtype)
        self.weight = base.weight
        self.weight.requires_grad_(False)
        self.lora_A = nn.Linear(base.in_features, rank, bias=False, dtype=base.weight.dtype)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False, dtype=base.weight.dtype)
        with torch.no_grad():  # PEFT's initialisation: A as a linear layer's, B zero
            bound = 1 / math.sqrt(base.in_features)
            self.lora_A.weight.uniform_(-bound, bound, generator=generator)
            self.lora_B.weight.zero_()
        self.scale = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The base projection plus the scaled adapter."""
        return F.linear(x, self.weight) + self.scale * self.lora_B(self.lora_A(x))


def add_adapters(model: nn.Module, rank: int, alpha: float, seed: int) -> int:
    """Freeze `model` and give every attention and MLP projection a trainable adapter (in
    place); returns how many projections got one."""
    generator = torch.Generator().manual_seed(seed)
    for param in model.parameters():
        param.requires_grad_(False)
    count = 0
    for name, module in list(model.named_modules()):
        if type(module) is nn.Linear and module.bias is None and TARGET_MODULES.fullmatch(name):
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent), leaf,
                    TrainableLoRA(module, rank, alpha, generator))
            count += 1
    return count


class LoRATrainer(LocalTrainer):
    """The policy with an adapter; its sender moves only the adapter, as `ADAPTER`."""

    def _policy(self, model: str) -> Any:
        policy = load_model(model, seed=0)
        self.projections = add_adapters(policy, LORA_RANK, LORA_ALPHA, seed=0)
        return policy

    def _source(self) -> WeightSource:
        return self.adapter()

    def adapter(self) -> LoRASource:
        """The adapter as it is now (what the sender sends)."""
        return LoRASource(ADAPTER, self.model, lora_alpha=LORA_ALPHA)

    def base_state(self) -> dict[str, torch.Tensor]:
        """The frozen base weights (the engine's model, never sent)."""
        return {k: v for k, v in self.state_dict().items() if ".lora_" not in k}

    def expected_fingerprint(self) -> dict[str, str]:
        """The base weights and the adapter under its wire names (both equal on the engine
        when it serves exactly this policy)."""
        return {**fingerprint(self.base_state()), **fingerprint(self.adapter().tensors())}

    def reference(self, server: Any) -> LoRAEngineReference:
        """A fresh engine holding the base weights and this adapter."""
        return LoRAEngineReference(server.model, self)


class LoRAEngineReference(FreshEngineReference):
    """A fresh engine holding the base weights and the trainer's adapter, received through
    ipc as the served engine received it; greedy continuations name the adapter."""

    def __init__(self, model: str, trainer: LoRATrainer) -> None:
        self.engine = AsyncEngine(EngineConfig(model=model, seed=0, batch_invariant=True,
                                               max_loras=1, max_lora_rank=LORA_RANK,
                                               update_staging="swap"))
        info = get_backend("ipc").sender_class().init_info_cls(bucket_bytes=1 << 20)
        with trainer_init(info, client=LocalEngineClient(self.engine),
                          source=trainer.adapter()) as sender:
            sender.send_weights(weight_version="reference")
        served = asyncio.run(self.engine.fingerprint())
        want = trainer.expected_fingerprint()
        if any(served.get(k) != v for k, v in want.items()):
            self.engine.shutdown()
            raise RuntimeError("the reference engine does not hold the trainer's policy")
        self.params = {"lora": ADAPTER}
