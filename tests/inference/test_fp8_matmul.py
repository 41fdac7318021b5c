"""The FP8 projection's block-scaled product (`wtransfer.inference.model.fp8_matmul`): the layouts
it hands cuBLAS (CPU), and on a Hopper GPU the product itself against the exact product of the
same FP8 operands."""

import pytest
import torch
import torch.nn.functional as F

from wtransfer.inference.model.fp8_linear import Fp8Linear
from wtransfer.inference.model.fp8_matmul import (
    block_scaled_linear,
    block_scaled_usable,
    quantize_activations,
    weight_scales,
)
from wtransfer.quant.fp8 import BLOCK, FP8, dequantize, quantize


def emulated(x, weight, scale):
    """x @ W^T from the FP8 operands the block-scaled product multiplies, in float32."""
    xq, xs = quantize_activations(x)
    tokens, inner = x.shape
    x_deq = (xq.float().view(-1, inner // BLOCK, BLOCK) * xs.unsqueeze(-1)).view(-1, inner)
    return x_deq[:tokens] @ dequantize(weight, scale, torch.float32).t()


def test_activations_are_fp8_groups_of_128_token_major():
    x = torch.randn(5, 256, dtype=torch.bfloat16) * torch.arange(1, 257)
    q, scale = quantize_activations(x)
    assert q.dtype == FP8 and q.shape == (16, 256)  # rows padded to 16, the pad zeros
    assert scale.shape == (16, 2) and scale.stride() == (1, 16)
    back = (q.float().view(16, 2, BLOCK) * scale.unsqueeze(-1)).view(16, 256)
    assert torch.equal(back[5:], torch.zeros(11, 256))
    torch.testing.assert_close(back[:5], x.float(), rtol=0.07, atol=0)
    group_max = x.float().view(5, 2, BLOCK).abs().amax(-1)
    torch.testing.assert_close(scale[:5] * 448.0, group_max)


def test_weight_scales_transposed_with_a_leading_dimension_of_four():
    scale = torch.arange(3 * 5, dtype=torch.float32).view(3, 5)  # [N/128, K/128]
    laid = weight_scales(scale)
    assert laid.shape == (5, 3) and laid.stride() == (1, 8)
    assert torch.equal(laid, scale.t())


def test_cpu_projection_dequantizes():
    weight = torch.randn(256, 384, dtype=torch.bfloat16)
    q, scale = quantize(weight)
    x = torch.randn(3, 384, dtype=torch.bfloat16)
    assert block_scaled_linear(x, q, scale) is None
    layer = Fp8Linear(256, 384)
    layer.weight.data.copy_(q)
    layer.weight_scale_inv.data.copy_(scale)
    assert torch.equal(layer(x), F.linear(x, dequantize(q, scale, x.dtype)))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tokens", [1, 7, 33])
def test_hopper_product_is_fp8_times_fp8(tokens):
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the block-scaled recipes run on Hopper (sm_90)")
    torch.manual_seed(tokens)
    weight = torch.randn(384, 512, device="cuda", dtype=torch.bfloat16) * 0.05
    weight[:128, :128] *= 40  # blocks far apart in scale: a misread scale shows
    q, scale = quantize(weight)
    x = torch.randn(2, tokens, 512, device="cuda", dtype=torch.bfloat16)
    x[..., 256:] *= 30
    out = block_scaled_linear(x, q, scale)
    assert out is not None, "the block-scaled product did not run on this Hopper GPU"
    assert block_scaled_usable("cuda") is True
    assert out.shape == (2, tokens, 384) and out.dtype == torch.bfloat16
    ref = emulated(x.reshape(-1, 512), q, scale).view(2, tokens, 384)
    assert float((out.float() - ref).norm() / ref.norm()) < 1e-2
    layer = Fp8Linear(384, 512, device="cuda")
    layer.weight.data.copy_(q)
    layer.weight_scale_inv.data.copy_(scale)
    assert torch.equal(layer(x), out)
