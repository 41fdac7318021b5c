"""An FP8 engine (`quantization="fp8"`) fed by a BF16 trainer: re-quantized as tensors land,
or quantized on the trainer (`Fp8Source`); both give the bytes a fresh FP8 engine holds."""

import asyncio
from dataclasses import replace

import pytest
import torch
from engine_helpers import collect, run
from wtransfer_ipc import IPCTrainerInitInfo
from wtransfer_nccl import NCCLTrainerInitInfo

import wtransfer
from wtransfer.errors import ConfigError, MetadataError
from wtransfer.inference import (
    MODEL_CONFIGS,
    AsyncEngine,
    EngineConfig,
    LocalEngineClient,
    SamplingParams,
)
from wtransfer.inference.model.decoder import load_model
from wtransfer.inference.model.parallel import check_fp8_shardable
from wtransfer.packing import TensorMeta
from wtransfer.quant.fp8 import (
    FP8,
    block_amax,
    dequantize,
    is_quantized,
    quantize,
    quantize_box,
)
from wtransfer.quant.source import Fp8Source
from wtransfer.shapes import perturb
from wtransfer.trainer.source import WeightSource

PROMPT = [5, 17, 33, 2, 9]
GREEDY = SamplingParams(max_tokens=16, temperature=0.0)


def fp8_engine(seed, model="tiny", **fields):
    return AsyncEngine(EngineConfig(model=model, seed=seed, dtype="bfloat16",
                                    quantization="fp8", **fields))


def info(backend, **fields):
    if backend == "nccl":
        return NCCLTrainerInitInfo(**{"master_address": "127.0.0.1", "world_size": 2,
                                      "timeout_s": 60, "bucket_bytes": 1 << 16, **fields})
    return IPCTrainerInitInfo(bucket_bytes=1 << 16, timeout_s=60, **fields)


def test_quantize_is_exact_per_block_and_deterministic():
    w = torch.randn(300, 200, dtype=torch.bfloat16)
    w[:128, :128] = 0  # an all-zero block: scale 1, values 0
    q, scale = quantize(w)
    assert q.dtype == FP8 and q.shape == w.shape and scale.shape == (3, 2)
    assert scale[0, 0] == 1 and not q[:128, :128].float().any()
    block = w[128:256, 128:200].float()
    assert scale[1, 1] == block.abs().max() / 448
    err = (dequantize(q, scale, torch.float32) - w.float()).abs()
    assert (err <= w.float().abs() * 2 ** -3 + scale.max() * 2 ** -9).all()  # e4m3: 3 bits
    again, again_scale = quantize(w.clone())
    assert torch.equal(again.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(again_scale, scale)
    experts = torch.stack([w, -w, w * 3])  # fused experts: each matrix on its own blocks
    eq, escale = quantize(experts)
    assert eq.shape == experts.shape and escale.shape == (3, 3, 2)
    for e in range(3):
        alone, alone_scale = quantize(experts[e])
        assert torch.equal(eq[e].view(torch.uint8), alone.view(torch.uint8))
        assert torch.equal(escale[e], alone_scale)
    assert torch.equal(dequantize(eq, escale, torch.float32)[1],
                       dequantize(*quantize(-w), torch.float32))


def _by_definition(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Block FP8 quantization written out block by block (the scheme's definition)."""
    rows, cols = w.shape
    scale = torch.ones(-(-rows // 128), -(-cols // 128))
    q = torch.empty(rows, cols, dtype=FP8)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            block = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128].float()
            amax = float(block.abs().max())  # float32 quotient, correctly rounded:
            scale[i, j] = amax / 448 if amax > 0 else 1.0  # (float64, then float32)
            q[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] = \
                (block / scale[i, j]).clamp(-448, 448).to(FP8)
    return q, scale


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32,
                                   torch.float64])
@pytest.mark.parametrize("shape", [(384, 256), (300, 200)])
def test_whole_and_partial_blocks_quantize_by_definition(shape, dtype):
    """Whole-block weights take the fast kernels, ragged ones the padded path; both give
    the bytes of the block-by-block definition, and so does a box of a sharded weight."""
    gen = torch.Generator().manual_seed(3)
    w = (torch.randn(shape, generator=gen) * torch.rand(shape, generator=gen) * 40).to(dtype)
    w[:128, 128:256] = 0
    w[5, 7] = -0.0
    q, scale = quantize(w)
    want_q, want_scale = _by_definition(w)
    assert torch.equal(scale, want_scale)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    box = (slice(128, 256), slice(0, 128))  # one rank's box, quantized with the global scales
    part = quantize_box(w[box], (128, 0), scale)
    assert torch.equal(part.view(torch.uint8), want_q[box].view(torch.uint8))
    amax = block_amax(w[box], (128, 0), tuple(w.shape))
    assert torch.equal(amax[1, 0], w[box].float().abs().max()) and amax.count_nonzero() <= 1
    out = (torch.full(shape, 7.0).to(FP8), torch.full(want_scale.shape, 3.0))
    into = quantize(w, out)  # into given buffers: the same bytes, in those buffers
    assert into[0] is out[0] and into[1] is out[1] and torch.equal(out[1], want_scale)
    assert torch.equal(out[0].view(torch.uint8), want_q.view(torch.uint8))
    with pytest.raises(ValueError, match="out must be contiguous"):  # a transposed buffer
        quantize(w, (torch.empty(shape[::-1]).to(FP8).t(), out[1]))


@pytest.mark.gpu
def test_the_triton_fp8_kernel_gives_the_eager_bytes_on_cuda():
    """On CUDA one Triton kernel quantizes a weight (used only where it matched the eager
    kernels on a probe): a Qwen3-sized projection, a box of it with the global scales, and
    fused experts give the bytes of the block-by-block definition."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from wtransfer.quant import fused
    w = torch.randn(2048, 1536, device="cuda", dtype=torch.bfloat16) * 0.02
    w[:128, :128] = 0
    kernel = fused.triton_for(w)
    try:
        import triton  # noqa: F401
    except ImportError:
        pytest.skip("Triton is not installed: the eager kernels run (tested on the host)")
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 conversion in Triton needs compute capability 8.9")
    assert kernel is not None, "the Triton kernel did not match the eager bytes here"
    direct_q, direct_scale = kernel.quantize(w)  # the kernel itself, then through quantize
    want_q, want_scale = _by_definition(w.cpu())
    assert torch.equal(direct_scale.cpu(), want_scale)
    assert torch.equal(direct_q.cpu().view(torch.uint8), want_q.view(torch.uint8))
    q, scale = quantize(w)
    assert torch.equal(scale.cpu(), want_scale)
    assert torch.equal(q.cpu().view(torch.uint8), want_q.view(torch.uint8))
    box = (slice(512, 1024), slice(256, 768))
    part = quantize_box(w[box], (512, 256), scale)
    assert torch.equal(part.cpu().view(torch.uint8), want_q[box].view(torch.uint8))
    experts = torch.stack([w[:256, :384], -w[256:512, :384] * 7])
    eq, escale = quantize(experts)
    for e in range(2):
        alone_q, alone_scale = _by_definition(experts[e].cpu())
        assert torch.equal(eq[e].cpu().view(torch.uint8), alone_q.view(torch.uint8))
        assert torch.equal(escale[e].cpu(), alone_scale)
    inner = experts[1:, 128:256, 128:384]  # a box of the experts, not at their origin
    boxed = quantize_box(inner, (1, 128, 128), escale)
    assert torch.equal(boxed.view(torch.uint8), eq[1:, 128:256, 128:384].view(torch.uint8))
    out = (torch.empty_like(eq), torch.full_like(escale, 3.0))  # into given buffers
    assert quantize(experts, out) == out
    assert torch.equal(out[0].view(torch.uint8), eq.view(torch.uint8))
    assert torch.equal(out[1], escale)


@pytest.mark.gpu
def test_fp8_source_quantizes_into_the_same_cuda_buffers_every_update():
    """`Fp8Source` on CUDA, once a sender reads its tensors in place (zero-copy), writes each
    update into buffers it keeps (the same storages every update): the bytes of a fresh
    `quantize` (the Triton kernel where it runs), changes included; kept or not, the same
    bytes."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    trainer = load_model("tiny-fp8", device="cuda:0", seed=1)
    kept, fresh = (Fp8Source(wtransfer.ModuleSource(trainer)) for _ in range(2))
    kept.read_in_place()  # as a zero-copy sender does at connect
    assert (kept.keep_buffers, fresh.keep_buffers) == (True, None)

    def walk(source):
        return {name: (t.data_ptr(), t.view(torch.uint8).clone() if t.dtype == FP8 else
                       t.clone()) for name, t in source.tensors()}

    first, again = walk(kept), walk(fresh)
    with torch.no_grad():
        for param in trainer.parameters():
            param.mul_(1.5)
    second = walk(kept)
    quantized = [n for n in first if n.endswith(".weight") and n + "_scale_inv" in first]
    assert quantized
    for name in quantized:
        want_q, want_scale = quantize(trainer.state_dict()[name])
        assert first[name][0] == second[name][0]  # the same storage both updates
        assert torch.equal(second[name][1], want_q.view(torch.uint8))
        assert torch.equal(second[name + "_scale_inv"][1], want_scale)
        assert torch.equal(first[name][1], again[name][1])  # kept or not: the same bytes


@pytest.mark.parametrize(("backend", "model"), [("ipc", "tiny"), ("nccl", "tiny"),
                                                ("ipc", "tiny-moe-fp8")])
def test_both_ways_of_feeding_an_fp8_engine_give_a_fresh_fp8_engines_weights(backend, model):
    """(a) BF16 sent, quantized by the engine; (b) quantized on the trainer, about half the
    projection bytes on the wire: both leave the engine with exactly the FP8 weights and scales
    of a fresh FP8 engine built from the same BF16 weights, generating the same tokens. A
    mixture-of-experts model's fused experts are quantized expert by expert."""
    async def main():
        engine = fp8_engine(seed=1, model=model, weight_transfer_backend=backend)
        fresh = fp8_engine(seed=5, model=model)
        trainer = load_model(model, seed=5, dtype="bfloat16")
        try:
            want = await fresh.fingerprint()
            assert await engine.fingerprint() != want
            moved = {}
            for way, source in (("a", wtransfer.ModuleSource(trainer)),
                                ("b", Fp8Source(wtransfer.ModuleSource(trainer)))):
                sender = await asyncio.to_thread(
                    wtransfer.trainer_init, info(backend), client=LocalEngineClient(engine),
                    source=source)
                moved[way] = (await asyncio.to_thread(sender.send_weights, way)).bytes
                await asyncio.to_thread(sender.shutdown)
                assert await engine.fingerprint() == want, way
                done = await collect(engine, f"r{way}", PROMPT, GREEDY)
                ref = await collect(fresh, f"r{way}", PROMPT, GREEDY)
                assert done.outputs[0].token_ids == ref.outputs[0].token_ids
            state = trainer.state_dict()
            projections = sum(t.numel() for n, t in state.items()
                              if is_quantized(n, tuple(t.shape)))
            if model == "tiny-moe-fp8":
                assert await engine.fingerprint() == want
                assert any(n.endswith("experts.gate_up_proj_scale_inv") for n in want)
            unique = {t.data_ptr(): t for t in state.values()}.values()  # tied weights once
            assert moved["a"] == sum(t.numel() * t.element_size() for t in unique)
            assert moved["a"] - moved["b"] >= projections * 0.9  # 2 -> 1 byte, plus scales
        finally:
            engine.shutdown()
            fresh.shutdown()

    run(main(), deadline_s=240)


@pytest.mark.parametrize(("backend", "model", "expert"), [
    ("ipc", "tiny-fp8", False), ("nccl", "tiny-moe-fp8", True),  # each way, dense and MoE;
    pytest.param("nccl", "tiny-fp8", False, marks=pytest.mark.extended),  # the same over the
    pytest.param("ipc", "tiny-moe-fp8", False, marks=pytest.mark.extended)])  # other backend
def test_two_fp8_workers_fed_both_ways_hold_one_fp8_engines_weights(backend, model, expert):
    """tensor_parallel_size=2: each worker keeps its rows (columns) of every FP8 projection
    and the matching block scales (of every expert: its gate and up rows and down columns,
    or with expert parallelism its whole experts); fed BF16 (quantized by the engine) or
    quantized on the trainer, the weights assembled from both workers equal a fresh
    one-worker FP8 engine's, and greedy tokens equal a fresh two-worker FP8 engine's built
    from the same weights."""
    async def main():
        def engine(seed, tp, **fields):
            return AsyncEngine(EngineConfig(model=model, seed=seed, dtype="bfloat16",
                                            quantization="fp8", tensor_parallel_size=tp,
                                            enable_expert_parallel=expert and tp > 1,
                                            **fields))

        split = engine(1, 2, weight_transfer_backend=backend, update_staging="swap")
        one, fresh = engine(5, 1), engine(5, 2)
        trainer = load_model(model, seed=5, dtype="bfloat16")
        try:
            want = await one.fingerprint()
            assert await fresh.fingerprint() == want  # two workers' parts, assembled
            assert await split.fingerprint() != want
            for way, source in (("a", wtransfer.ModuleSource(trainer)),
                                ("b", Fp8Source(wtransfer.ModuleSource(trainer)))):
                fields = {"world_size": 3} if backend == "nccl" else {}
                sender = await asyncio.to_thread(
                    wtransfer.trainer_init, info(backend, **fields),
                    client=LocalEngineClient(split), source=source)
                await asyncio.to_thread(sender.send_weights, way)
                await asyncio.to_thread(sender.shutdown)
                assert await split.fingerprint() == want, way
                done = await collect(split, f"r{way}", PROMPT, GREEDY)
                ref = await collect(fresh, f"r{way}", PROMPT, GREEDY)
                assert done.outputs[0].token_ids == ref.outputs[0].token_ids
        finally:
            for e in (split, one, fresh):
                e.shutdown()

    run(main(), deadline_s=300)


def test_a_staged_fp8_update_mid_flight_and_deltas_after_quantizing():
    """Requests keep streaming while an FP8 update stages (swap); after it, deltas of the
    quantized weights move only the changed FP8 values and scales, bit-exact."""
    async def main():
        engine = fp8_engine(seed=1, update_staging="swap")
        trainer = load_model("tiny", seed=5, dtype="bfloat16")
        try:
            running = asyncio.create_task(collect(engine, "long", PROMPT,
                                                  SamplingParams(max_tokens=64, temperature=0)))
            sender = await asyncio.to_thread(
                wtransfer.trainer_init, info("ipc", delta=True),
                client=LocalEngineClient(engine), source=Fp8Source(wtransfer.ModuleSource(trainer)))
            first = await asyncio.to_thread(sender.send_weights, "q0")
            out = await running
            spans = out.outputs[0].weight_versions
            assert [s.version for s in spans][-1] == "q0"
            for step in range(1, 4):
                perturb(trainer, 0.002, seed=step)
                stats = await asyncio.to_thread(sender.send_weights, f"q{step}")
                assert stats.wire_bytes < first.bytes / 4
                want = fp8_engine(seed=0)
                try:
                    fresh_sender = await asyncio.to_thread(
                        wtransfer.trainer_init, info("ipc"), client=LocalEngineClient(want),
                        source=wtransfer.ModuleSource(trainer))
                    await asyncio.to_thread(fresh_sender.send_weights)
                    await asyncio.to_thread(fresh_sender.shutdown)
                    assert await engine.fingerprint() == await want.fingerprint(), step
                finally:
                    want.shutdown()
            await asyncio.to_thread(sender.shutdown)
        finally:
            engine.shutdown()

    run(main(), deadline_s=240)


class _Without(WeightSource):
    """An `Fp8Source` with some tensors left out, or one of them replaced."""

    def __init__(self, inner, drop=(), replace=None):
        self.inner, self.drop, self.replace = inner, set(drop), replace or {}

    def metadata(self):
        return [TensorMeta.of(n, self.replace[n]) if n in self.replace else m
                for m in self.inner.metadata() for n in [m.name] if n not in self.drop]

    def tensors(self):
        for name, tensor in self.inner.tensors():
            if name not in self.drop:
                yield name, self.replace.get(name, tensor)


async def fails_untouched(engine, source, before, error, match):
    """An update of `source` fails with `error` and the engine holds `before`, not torn."""
    with wtransfer.trainer_init(info("ipc"), client=LocalEngineClient(engine),
                                source=source) as sender, pytest.raises(error, match=match):
        await asyncio.to_thread(sender.send_weights)
    assert await engine.fingerprint() == before
    assert not (await engine.weight_info())["torn"]


def test_malformed_scales_and_a_weight_without_its_scales_are_refused_before_any_write():
    async def main():
        engine = fp8_engine(seed=1, update_staging="off", update_rollback=True)
        trainer = load_model("tiny", seed=5, dtype="bfloat16")
        name = "model.layers.0.mlp.up_proj.weight_scale_inv"
        try:
            before = await engine.fingerprint()
            bad = _Without(Fp8Source(wtransfer.ModuleSource(trainer)),
                           replace={name: torch.ones(3, 3)})
            await fails_untouched(engine, bad, before, MetadataError,
                                  r"up_proj.weight_scale_inv.*float32")
            missing = _Without(Fp8Source(wtransfer.ModuleSource(trainer)), drop={name})
            await fails_untouched(engine, missing, before, MetadataError, "without their scales")
            lone = _Without(Fp8Source(wtransfer.ModuleSource(trainer)),
                            drop={name.removesuffix("_scale_inv")})
            await fails_untouched(engine, lone, before, MetadataError,
                                  r"scales '.*up_proj.weight_scale_inv' without their FP8 "
                                  r"weight")
            wide = load_model("tiny", seed=5, dtype="float32")
            await fails_untouched(engine, wtransfer.ModuleSource(wide), before, MetadataError,
                                  r"'model.layers.0.self_attn.q_proj.weight' sent as float32; "
                                  r"this FP8 engine takes it in its checkpoint dtype bfloat16")
        finally:
            engine.shutdown()

    run(main(), deadline_s=240)


def test_fp8_settings_that_are_not_served_are_refused():
    with pytest.raises(ConfigError, match="quantization must be 'fp8' or None"):
        EngineConfig(model="tiny", quantization="int4")
    with pytest.raises(ConfigError, match=r"whole 128x128 blocks; per worker: .*q_proj rows"):
        AsyncEngine(EngineConfig(model="tiny", quantization="fp8", tensor_parallel_size=2))
    with pytest.raises(ConfigError, match="tensor_parallel_size=3 must divide"):
        AsyncEngine(EngineConfig(model="tiny-fp8", quantization="fp8", tensor_parallel_size=3))
    narrow = replace(MODEL_CONFIGS["tiny-moe-fp8"], moe_intermediate_size=128)
    with pytest.raises(ConfigError, match=r"per worker: \{'expert gate/up rows, down columns "
                                          r"\(moe_intermediate_size\)': 64\}"):
        check_fp8_shardable(narrow, 2)
    check_fp8_shardable(narrow, 2, expert=True)  # whole experts per worker: whole blocks


class _FailsHalfway(WeightSource):
    """The trainer's tensors, failing after the first few (a trainer dying mid-update)."""

    def __init__(self, inner):
        self.inner = inner

    def metadata(self):
        return self.inner.metadata()

    def tensors(self):
        for index, item in enumerate(self.inner.tensors()):
            if index == 24:  # after buckets of quantized weights landed
                raise RuntimeError("the trainer failed mid-update")
            yield item


def test_a_failed_bf16_update_rolls_back_the_fp8_weights_and_their_scales():
    """In place with rollback: the engine quantized some BF16 weights (new values and new
    scales) before the trainer failed; both are restored, so the engine is its old self."""
    async def main():
        engine = fp8_engine(seed=1, update_staging="off", update_rollback=True)
        trainer = load_model("tiny", seed=5, dtype="bfloat16")
        try:
            before = await engine.fingerprint()
            await fails_untouched(engine, _FailsHalfway(wtransfer.ModuleSource(trainer)), before,
                                  RuntimeError, "failed mid-update")
        finally:
            engine.shutdown()

    run(main(), deadline_s=240)


def test_a_delta_where_an_fp8_weight_changes_whole_and_its_scales_do_not_lands():
    """Negating a weight keeps every block's amax (scales unchanged, left out of the delta)
    while every FP8 value changes (sent dense): the delta lands bit-exact."""
    async def main():
        engine = fp8_engine(seed=1, update_staging="swap")
        trainer = load_model("tiny", seed=5, dtype="bfloat16")
        try:
            sender = await asyncio.to_thread(
                wtransfer.trainer_init, info("ipc", delta=True), client=LocalEngineClient(engine),
                source=Fp8Source(wtransfer.ModuleSource(trainer)))
            first = await asyncio.to_thread(sender.send_weights, "0")
            with torch.no_grad():
                trainer.model.layers[0].mlp.up_proj.weight.neg_()
            stats = await asyncio.to_thread(sender.send_weights, "1")
            assert stats.wire_bytes < first.bytes / 2
            await asyncio.to_thread(sender.shutdown)
            want = fp8_engine(seed=0)
            try:
                await push_full(want, trainer)
                assert await engine.fingerprint() == await want.fingerprint()
            finally:
                want.shutdown()
        finally:
            engine.shutdown()

    run(main(), deadline_s=240)


def test_deltas_into_an_fp8_engine_with_adapter_slots_land_every_time():
    """The weight changes whole while its scales do not (negated), update after update, into
    an engine that also serves adapters: each delta lands (it failed every other update when
    the adapter layer hid the scales that belong to a weight)."""
    async def main():
        engine = fp8_engine(seed=1, update_staging="swap", max_loras=1)
        trainer = load_model("tiny", seed=5, dtype="bfloat16")
        try:
            sender = await asyncio.to_thread(
                wtransfer.trainer_init, info("ipc", delta=True), client=LocalEngineClient(engine),
                source=Fp8Source(wtransfer.ModuleSource(trainer)))
            first = await asyncio.to_thread(sender.send_weights, "0")
            for step in range(1, 4):
                with torch.no_grad():
                    trainer.model.layers[0].mlp.up_proj.weight.neg_()
                stats = await asyncio.to_thread(sender.send_weights, str(step))
                assert stats.changed_fraction is not None, step  # a delta, not a resend
                assert stats.wire_bytes < first.bytes / 2
            await asyncio.to_thread(sender.shutdown)
            want = fp8_engine(seed=0)
            try:
                await push_full(want, trainer)
                held = await engine.fingerprint()
                assert {n: held[n] for n in await want.fingerprint()} == \
                    await want.fingerprint()
            finally:
                want.shutdown()
        finally:
            engine.shutdown()

    run(main(), deadline_s=240)


async def push_full(engine, trainer):
    sender = await asyncio.to_thread(wtransfer.trainer_init, info("ipc"),
                                     client=LocalEngineClient(engine),
                                     source=wtransfer.ModuleSource(trainer))
    await asyncio.to_thread(sender.send_weights)
    await asyncio.to_thread(sender.shutdown)


def test_sharded_weights_on_two_meshes_each_get_their_own_scales():
    """`Fp8Source` over DTensors on two device meshes (attention on one, experts on a 2-D
    other, as trainers that place experts apart do): every FP8 weight comes with its own
    scales, the same bytes as quantizing the full weight."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from wtransfer.launch.processes import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    try:
        model = load_model("tiny-moe-fp8", seed=3, dtype="bfloat16")
        flat, square = init_device_mesh("cpu", (1,)), init_device_mesh("cpu", (1, 1))
        want = {}
        for name, module in model.named_modules():
            for leaf, param in list(module.named_parameters(recurse=False)):
                full = f"{name}.{leaf}"
                if not is_quantized(full, tuple(param.shape)):
                    continue
                want[full] = quantize(param.detach())
                mesh, places = ((square, [Shard(0), Shard(0)]) if "experts" in full
                                else (flat, [Shard(0)]))
                setattr(module, leaf, torch.nn.Parameter(
                    distribute_tensor(param.detach(), mesh, places), requires_grad=False))
        source = Fp8Source(wtransfer.ModuleSource(model))
        assert source.sharded
        names = [m.name for m in source.metadata()]
        parts = dict(zip(names, source.parts(), strict=True))
        assert len(want) > 4 and any("experts" in n for n in want)
        for name, (q, scale) in want.items():
            got = parts[name].to_local()
            assert torch.equal(got.view(torch.uint8), q.view(torch.uint8)), name
            assert torch.equal(parts[name + "_scale_inv"], scale), name
    finally:
        dist.destroy_process_group()
