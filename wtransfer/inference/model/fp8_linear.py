"""FP8 linear layers and experts for the engine (`EngineConfig(quantization="fp8")`): the
scheme of `wtransfer.quant.fp8`. On a Hopper GPU a projection multiplies FP8 x FP8 with its
block scales on the tensor cores (`wtransfer.inference.model.fp8_matmul`); elsewhere, and for the
experts, the weight is dequantized on the fly in the forward (correct on every device, not
fast)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from wtransfer.inference.model.experts import Experts
from wtransfer.inference.model.fp8_matmul import block_scaled_linear
from wtransfer.quant.fp8 import FP8, dequantize, is_quantized, quantize, scale_shape


class Fp8Linear(nn.Module):
    """A bias-free linear layer whose weight is FP8 with block scales: its state is
    ``weight`` (float8_e4m3fn) and ``weight_scale_inv`` (float32), a checkpoint's names."""

    def __init__(self, out_features: int, in_features: int,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8,
                                               device=device), requires_grad=False)
        self.weight_scale_inv = nn.Parameter(
            torch.ones(scale_shape((out_features, in_features)), dtype=torch.float32,
                       device=device), requires_grad=False)

    @classmethod
    def of(cls, linear: nn.Linear) -> Fp8Linear:
        """`linear`'s weight quantized."""
        out = cls(linear.out_features, linear.in_features, device=linear.weight.device)
        q, scale = quantize(linear.weight)
        out.weight.data.copy_(q)
        out.weight_scale_inv.data.copy_(scale)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W^T: FP8 x FP8 with block scales where cuBLAS runs it, else with W dequantized
        in x's dtype."""
        out = block_scaled_linear(x, self.weight, self.weight_scale_inv)
        if out is not None:
            return out
        return F.linear(x, dequantize(self.weight, self.weight_scale_inv, x.dtype))


class Fp8Experts(Experts):
    """A MoE layer's fused experts in FP8: ``gate_up_proj`` and ``down_proj`` as
    float8_e4m3fn, each with ``<name>_scale_inv`` holding every expert's block scales
    ([experts, row blocks, column blocks]); an expert is dequantized when tokens reach it."""

    def __init__(self, experts: Experts) -> None:
        nn.Module.__init__(self)
        self.first = experts.first
        q, scale = quantize(experts.gate_up_proj)
        self.gate_up_proj = nn.Parameter(q, requires_grad=False)
        self.gate_up_proj_scale_inv = nn.Parameter(scale, requires_grad=False)
        q, scale = quantize(experts.down_proj)
        self.down_proj = nn.Parameter(q, requires_grad=False)
        self.down_proj_scale_inv = nn.Parameter(scale, requires_grad=False)

    def gate_up(self, local: int, dtype: torch.dtype) -> torch.Tensor:
        """Expert `local`'s gate and up rows, dequantized in `dtype`."""
        return dequantize(self.gate_up_proj[local], self.gate_up_proj_scale_inv[local], dtype)

    def down(self, local: int, dtype: torch.dtype) -> torch.Tensor:
        """Expert `local`'s down projection, dequantized in `dtype`."""
        return dequantize(self.down_proj[local], self.down_proj_scale_inv[local], dtype)


def quantize_model(model: nn.Module) -> nn.Module:
    """Replace every projection the scheme quantizes (`is_quantized`) by an `Fp8Linear`
    holding its weight quantized, and every layer's experts by `Fp8Experts`, in place;
    returns `model`."""
    for name, module in list(model.named_modules()):
        parent_name, _, leaf = name.rpartition(".")
        if isinstance(module, nn.Linear) and module.bias is None and \
                is_quantized(f"{name}.weight", tuple(module.weight.shape)):
            setattr(model.get_submodule(parent_name), leaf, Fp8Linear.of(module))
        elif type(module) is Experts and \
                is_quantized(f"{name}.gate_up_proj", tuple(module.gate_up_proj.shape)):
            setattr(model.get_submodule(parent_name), leaf, Fp8Experts(module))
    return model
