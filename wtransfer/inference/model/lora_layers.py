"""LoRA layers: each attention and MLP projection as a `LoRALinear` (a `LoRAFp8Linear` on an
FP8 engine) with K adapter slots that a step's rows select (`LoRARows`). What fills the slots
is `wtransfer.inference.updates.lora` (docs/lora.md)."""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from wtransfer.errors import ConfigError
from wtransfer.inference.model.fp8_linear import Fp8Linear

TARGET_MODULES = re.compile(r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj"
                            r"|mlp\.(gate|up|down)_proj)")
"""The modules that take adapters: every layer's attention and MLP projections."""


class LoRARows:
    """The adapter slot of every row of the step being computed (-1: the base model)."""

    def __init__(self) -> None:
        self.rows: torch.Tensor | None = None
        self.used: list[int] = []
        self.uniform: int | None = None
        """The one slot every row uses, when they all use the same adapter (then a layer
        adds it to the whole batch, without selecting rows)."""


class LoRASlots(nn.Module):
    """`slots` adapter slots of rank up to `rank` on a bias-free projection (`LoRALinear`,
    `LoRAFp8Linear`): ``lora_A`` [K, R, in], ``lora_B`` [K, out, R], ``lora_scale`` [K] in
    the checkpoint's dtype, and the rows holder saying which slot each row uses."""

    lora_A: nn.Parameter
    lora_B: nn.Parameter
    lora_scale: nn.Parameter
    _rows: LoRARows

    def _add_slots(self, shape: tuple[int, int], slots: int, rank: int, rows: LoRARows,
                   device: torch.device, dtype: torch.dtype) -> None:
        out_features, in_features = shape
        self.lora_A = nn.Parameter(torch.zeros(slots, rank, in_features, device=device,
                                               dtype=dtype), requires_grad=False)
        self.lora_B = nn.Parameter(torch.zeros(slots, out_features, rank, device=device,
                                               dtype=dtype), requires_grad=False)
        self.lora_scale = nn.Parameter(torch.zeros(slots, device=device, dtype=dtype),
                                       requires_grad=False)
        self._rows = rows

    def _with_adapters(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """`y` (the base projection of `x`) plus each row's adapter: scale * B (A x)."""
        rows = self._rows.rows
        if rows is None:
            return y
        uniform = self._rows.uniform
        if uniform is not None:
            return y + self.lora_scale[uniform] * F.linear(F.linear(x, self.lora_A[uniform]),
                                                           self.lora_B[uniform])
        for slot in self._rows.used:
            pick = rows == slot
            delta = F.linear(F.linear(x[pick], self.lora_A[slot]), self.lora_B[slot])
            y[pick] += self.lora_scale[slot] * delta
        return y


class LoRALinear(LoRASlots, nn.Linear):
    """A bias-free projection with adapter slots (see `LoRASlots`)."""

    def __init__(self, base: nn.Linear, slots: int, rank: int, rows: LoRARows) -> None:
        nn.Linear.__init__(self, base.in_features, base.out_features, bias=False,
                           device=base.weight.device, dtype=base.weight.dtype)
        self.weight = base.weight
        self._add_slots((base.out_features, base.in_features), slots, rank, rows,
                        base.weight.device, base.weight.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """W x, plus each row's adapter."""
        return self._with_adapters(x, F.linear(x, self.weight))


class LoRAFp8Linear(LoRASlots, Fp8Linear):
    """An FP8 projection (`Fp8Linear`: its weight and block scales) with adapter slots in the
    checkpoint's dtype `dtype` (see `LoRASlots`)."""

    def __init__(self, base: Fp8Linear, slots: int, rank: int, rows: LoRARows,
                 dtype: torch.dtype) -> None:
        out_features, in_features = base.weight.shape
        Fp8Linear.__init__(self, out_features, in_features, device=base.weight.device)
        self.weight, self.weight_scale_inv = base.weight, base.weight_scale_inv
        self._add_slots((out_features, in_features), slots, rank, rows, base.weight.device,
                        dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The dequantized W x, plus each row's adapter."""
        return self._with_adapters(x, Fp8Linear.forward(self, x))


def enable_lora(model: nn.Module, slots: int, rank: int,
                dtype: torch.dtype | None = None) -> LoRARows:
    """Give every attention and MLP projection of `model` adapter slots (in place: a
    `LoRALinear`, or a `LoRAFp8Linear` for an FP8 one, whose slots take `dtype`, the
    checkpoint's); returns the rows holder the runner sets before each forward."""
    rows = LoRARows()
    for name, module in list(model.named_modules()):
        if not TARGET_MODULES.fullmatch(name):
            continue
        parent, _, leaf = name.rpartition(".")
        if type(module) is Fp8Linear:
            if dtype is None:
                raise ConfigError("adapters on an FP8 model need the checkpoint dtype")
            swapped: nn.Module = LoRAFp8Linear(module, slots, rank, rows, dtype)
        elif type(module) is nn.Linear and module.bias is None:
            swapped = LoRALinear(module, slots, rank, rows)
        else:
            continue
        setattr(model.get_submodule(parent), leaf, swapped)
    return rows
