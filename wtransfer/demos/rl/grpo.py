"""One GRPO-style policy-gradient step: group-normalized advantages, with a truncated
importance weight against the engine's own logprobs, because with one-off pipelining the
rollouts come from the previous step's weights (some tokens from the step before)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from wtransfer.inference.model.decoder import Qwen3ForCausalLM


@dataclass
class Rollout:
    """One sampled completion as the engine reported it."""

    prompt: list[int]
    tokens: list[int]
    logprobs: list[float]
    versions: list[tuple[str, int, int]]
    reward: float = 0.0


def advantages(rewards: torch.Tensor, group: int) -> torch.Tensor:
    """Rewards normalized within each group of `group` samples of one prompt."""
    r = rewards.view(-1, group)
    return ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)).view(-1)


def grpo_step(model: Qwen3ForCausalLM, optimizer: torch.optim.Optimizer,
              rollouts: list[Rollout], group: int, max_weight: float = 2.0) -> dict[str, float]:
    """Update `model` on `rollouts` (ordered by prompt, `group` per prompt)."""
    model.train()
    adv = advantages(torch.tensor([r.reward for r in rollouts]), group)
    logits = model.sequence_logits([r.prompt + r.tokens for r in rollouts])
    total = torch.zeros(())
    count = 0
    for rollout, seq_logits, a in zip(rollouts, logits, adv, strict=True):
        start = len(rollout.prompt) - 1
        targets = torch.tensor(rollout.tokens)
        new = torch.log_softmax(seq_logits[start:-1], -1).gather(1, targets[:, None]).squeeze(1)
        weight = torch.exp(new.detach() - torch.tensor(rollout.logprobs)).clamp(max=max_weight)
        total = total - (weight * a * new).sum()
        count += len(rollout.tokens)
    loss = total / max(count, 1)
    optimizer.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    model.eval()
    return {"loss": float(loss.detach())}
