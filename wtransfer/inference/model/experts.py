"""The experts of one mixture-of-experts layer (`Experts`), apart from the model so the FP8
layers (`wtransfer.inference.model.fp8_linear`) can build on them."""

from __future__ import annotations

import torch
from torch import nn

from wtransfer.inference.config import ModelConfig
from wtransfer.inference.model.parallel import ALONE, Parallel


class Experts(nn.Module):
    """The experts of one MoE layer as two fused tensors, as transformers holds them:
    ``gate_up_proj`` [experts, 2 x width, hidden] (gate rows, then up rows) and ``down_proj``
    [experts, hidden, width]; a checkpoint's per-expert tensors load into them."""

    def __init__(self, cfg: ModelConfig, par: Parallel = ALONE) -> None:
        super().__init__()
        count = cfg.num_experts // par.size if par.expert else cfg.num_experts
        width = cfg.moe_intermediate_size if par.expert else cfg.moe_intermediate_size // par.size
        self.first = par.span(cfg.num_experts)[0] if par.expert else 0
        """The global index of this rank's first expert."""
        self.gate_up_proj = nn.Parameter(torch.empty(count, 2 * width, cfg.hidden_size))
        self.down_proj = nn.Parameter(torch.empty(count, cfg.hidden_size, width))

    def gate_up(self, local: int, dtype: torch.dtype) -> torch.Tensor:
        """This rank's expert `local`'s gate and up rows [2 x width, hidden] in `dtype`."""
        return self.gate_up_proj[local]

    def down(self, local: int, dtype: torch.dtype) -> torch.Tensor:
        """This rank's expert `local`'s down projection [hidden, width] in `dtype`."""
        return self.down_proj[local]
