"""The fused RMSNorm and rotation (`wtransfer.inference.model.fused`, Triton kernels the model
uses on CUDA outside autograd) give the eager chains' values, and an engine running them gives
the tokens of one that does not (`WTRANSFER_FUSED_LAYERS=0`). Tolerances: torch's defaults
for the dtype (the kernels sum in another order and may fuse a multiply and an add)."""

import pytest
import torch
from engine_helpers import run, tokens_of, triton_kernels

from wtransfer.inference import AsyncEngine, EngineConfig, SamplingParams
from wtransfer.inference.model import layer_kernels
from wtransfer.inference.model.attention import rotary_tables, rotate
from wtransfer.inference.model.decoder import RMSNorm

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def fused():
    return triton_kernels("fused")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(16, 1024), (5, 4096), (16, 8, 128), (3, 7, 100)])
def test_the_fused_rms_norm_gives_the_eager_values(fused, dtype, shape, monkeypatch):
    norm = RMSNorm(shape[-1], 1e-6).cuda().to(dtype)
    norm.weight.data.normal_()
    x = torch.randn(shape, device="cuda").to(dtype)
    with torch.no_grad():
        assert layer_kernels.fused_for(x) is fused  # (its trial passed on this card)
        got = norm(x)
        monkeypatch.setenv("WTRANSFER_FUSED_LAYERS", "0")
        want = norm(x)
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got, want)  # (the sum's order differs: a rounding)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_fused_rotation_gives_the_eager_values(fused, dtype, monkeypatch):
    x = torch.randn(9, 8, 128, device="cuda").to(dtype)
    cos, sin = rotary_tables(torch.arange(9, device="cuda") * 37, 128, 1e6)
    with torch.no_grad():
        assert layer_kernels.fused_for(x) is fused
        got = rotate(x, cos.unsqueeze(1), sin.unsqueeze(1))
        monkeypatch.setenv("WTRANSFER_FUSED_LAYERS", "0")
        want = rotate(x, cos.unsqueeze(1), sin.unsqueeze(1))
    assert got.dtype == dtype
    torch.testing.assert_close(got, want)


def test_an_engine_with_fused_layers_gives_the_eager_layers_tokens(fused, monkeypatch):
    params = SamplingParams(max_tokens=24, temperature=0.0)
    prompts = {f"r{i}": [(7 * i + 5 * j) % 256 for j in range(3 + i % 5)] for i in range(8)}

    async def tokens():
        engine = AsyncEngine(EngineConfig(model="tiny", device="cuda"))
        try:
            return await tokens_of(engine, prompts, params)
        finally:
            engine.shutdown()

    async def main():
        fused_tokens = await tokens()
        monkeypatch.setenv("WTRANSFER_FUSED_LAYERS", "0")
        assert await tokens() == fused_tokens
    run(main())
