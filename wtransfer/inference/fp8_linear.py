"""FP8 linear layers for the engine (`EngineConfig(quantization="fp8")`): the scheme of
`wtransfer.quant.fp8`, dequantized on the fly in the forward (correct on every device, not
fast: torch's scaled matmul takes per-tensor or row-wise scales, not 128 x 128 blocks)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

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
        """x @ W^T with W dequantized in x's dtype."""
        return F.linear(x, dequantize(self.weight, self.weight_scale_inv, x.dtype))


def quantize_model(model: nn.Module) -> nn.Module:
    """Replace every projection the scheme quantizes (`is_quantized`) by an `Fp8Linear`
    holding its weight quantized, in place; returns `model`."""
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear) and module.bias is None and \
                is_quantized(f"{name}.weight", tuple(module.weight.shape)):
            parent_name, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent_name), leaf, Fp8Linear.of(module))
    return model
