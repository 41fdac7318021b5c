"""LoRA adapters moved alone, in memory, into our engine: tokens with an adapter equal a
reference model with the adapter merged (fp32), base-model requests are untouched, an adapter
update mid-flight splits only that adapter's requests' spans, and bad adapters are refused."""

import asyncio

import pytest
import torch
from engine_helpers import collect, run, until
from wtransfer_ipc import IPCTrainerInitInfo
from wtransfer_nccl import NCCLTrainerInitInfo

import wtransfer
from wtransfer.errors import ConfigError, MetadataError, NonFiniteError
from wtransfer.inference import AsyncEngine, EngineConfig, LocalEngineClient, SamplingParams
from wtransfer.inference.model.decoder import load_model
from wtransfer.packing import TensorMeta
from wtransfer.trainer.lora import LoRASource
from wtransfer.trainer.source import WeightSource

PROMPT = [3, 14, 15, 92, 6]
PROJECTIONS = ("q_proj", "v_proj", "o_proj", "up_proj", "down_proj")


def peft_adapter(base, rank, seed, modules=PROJECTIONS):
    """Random factors in PEFT's naming and layout for `modules` of every layer."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, weight in base.named_parameters():
        module = name.removesuffix(".weight")
        if module.rsplit(".", 1)[-1] in modules:
            out[f"base_model.model.{module}.lora_A.default.weight"] = (
                torch.randn(rank, weight.shape[1], generator=gen) * 0.3)
            out[f"base_model.model.{module}.lora_B.default.weight"] = (
                torch.randn(weight.shape[0], rank, generator=gen) * 0.3)
    return out


def merged(seed, adapter, alpha, rank):
    model = load_model("tiny", seed=seed)
    state = model.state_dict()
    with torch.no_grad():
        for key, a in adapter.items():
            if ".lora_A." in key:
                module = key.removeprefix("base_model.model.").split(".lora_A.")[0]
                b = adapter[key.replace(".lora_A.", ".lora_B.")]
                state[module + ".weight"].add_(alpha / rank * b @ a)
    return model


def info(backend):
    if backend == "nccl":
        return NCCLTrainerInitInfo(master_address="127.0.0.1", world_size=2, timeout_s=60,
                                   bucket_bytes=1 << 16)
    # "ipc-m2n": each worker crops what it keeps out of the staging (adapters it keeps whole)
    return IPCTrainerInitInfo(bucket_bytes=1 << 16, timeout_s=60, m2n=backend == "ipc-m2n")


async def push(engine, source, version, backend="ipc"):
    sender = await asyncio.to_thread(wtransfer.trainer_init, info(backend),
                                     client=LocalEngineClient(engine), source=source)
    try:
        return await asyncio.to_thread(sender.send_weights, version)
    finally:
        await asyncio.to_thread(sender.shutdown)


async def tokens(engine, lora=None, rid="r"):
    out = await collect(engine, rid, PROMPT, SamplingParams(max_tokens=16, temperature=0,
                                                            lora=lora))
    return out.outputs[0]


@pytest.mark.parametrize("backend", ["ipc", "nccl", "ipc-m2n"])
def test_adapter_tokens_equal_the_merged_model_and_only_adapter_bytes_move(backend):
    async def main():
        engine = AsyncEngine(EngineConfig(model="tiny", seed=1, max_loras=2, max_lora_rank=8,
                                          weight_transfer_backend=backend.removesuffix("-m2n")))
        plain = AsyncEngine(EngineConfig(model="tiny", seed=1))
        reference = AsyncEngine(EngineConfig(model="tiny", seed=9))
        base = load_model("tiny", seed=1)
        adapter = peft_adapter(base, rank=4, seed=0)
        try:
            source = LoRASource("math", adapter, lora_alpha=8)
            stats = await push(engine, source, "m1", backend)
            assert stats.bytes == sum(t.numel() * 4 for t in adapter.values()) + 4
            served = await engine.fingerprint()  # the adapter as sent, read out of its slot
            sent = wtransfer.fingerprint(source.tensors())
            assert {k: served.get(k) for k in sent} == sent
            other = wtransfer.fingerprint(LoRASource("math", peft_adapter(base, 4, seed=5),
                                                     lora_alpha=8).tensors())
            assert not any(served.get(k) == v for k, v in other.items()
                           if not k.endswith("lora_alpha"))
            assert (await engine.weight_info())["adapters"] == {"math": "m1"}
            await push(reference, wtransfer.ModuleSource(merged(1, adapter, 8, 4)), "merged")
            with_adapter = await tokens(engine, "math")
            assert with_adapter.token_ids == (await tokens(reference)).token_ids
            assert [s.version for s in with_adapter.weight_versions] == ["m1"]
            on_base = await tokens(engine)
            assert on_base.token_ids == (await tokens(plain)).token_ids
            assert on_base.token_ids != with_adapter.token_ids
            assert [s.version for s in on_base.weight_versions] == ["default"]
        finally:
            for e in (engine, plain, reference):
                e.shutdown()

    run(main(), deadline_s=240)


def test_an_adapter_update_mid_flight_splits_only_its_requests():
    """Staged: a new version of "math" lands while a "math" request and a base request
    stream; the math request's spans split at the commit and its tail equals the merged new
    adapter; the base request keeps one span and its tokens; a second adapter takes another
    slot and leaves "math" as it is."""
    async def main():
        engine = AsyncEngine(EngineConfig(model="tiny", seed=1, max_loras=2, max_lora_rank=8,
                                          update_staging="swap", batch_invariant=True))
        base = load_model("tiny", seed=1)
        first, second = peft_adapter(base, 4, seed=0), peft_adapter(base, 4, seed=1)
        try:
            await push(engine, LoRASource("math", first, lora_alpha=8), "m1")
            progress = {}
            long = SamplingParams(max_tokens=400, temperature=0, lora="math")
            on_math = asyncio.create_task(collect(engine, "math", PROMPT, long, progress))
            on_base = asyncio.create_task(collect(engine, "base", PROMPT, SamplingParams(
                max_tokens=400, temperature=0), progress))
            await until(lambda: len(progress) == 2 and min(progress.values()) >= 3,
                        "both requests to start")
            await push(engine, LoRASource("math", second, lora_alpha=8), "m2")
            math_out, base_out = (await on_math).outputs[0], (await on_base).outputs[0]
            old, new = math_out.weight_versions
            assert (old.version, new.version) == ("m1", "m2") and old.end == new.start
            assert [s.version for s in base_out.weight_versions] == ["default"]
            plain = AsyncEngine(EngineConfig(model="tiny", seed=1, batch_invariant=True))
            ref = AsyncEngine(EngineConfig(model="tiny", seed=9, batch_invariant=True))
            try:
                assert base_out.token_ids == (await collect(plain, "b", PROMPT, SamplingParams(
                    max_tokens=400, temperature=0))).outputs[0].token_ids
                await push(ref, wtransfer.ModuleSource(merged(1, second, 8, 4)), "merged")
                k = old.end
                tail = await collect(ref, "t", PROMPT + math_out.token_ids[:k], SamplingParams(
                    max_tokens=400 - k, temperature=0))
                assert tail.outputs[0].token_ids == math_out.token_ids[k:]
            finally:
                plain.shutdown()
                ref.shutdown()
            before = (await tokens(engine, "math")).token_ids
            await push(engine, LoRASource("code", first, lora_alpha=4), "c1")
            assert (await tokens(engine, "math")).token_ids == before
            assert (await tokens(engine, "code")).weight_versions[0].version == "c1"
            assert await engine.get_weight_version() == "default"  # adapters only
        finally:
            engine.shutdown()

    run(main(), deadline_s=240)


class AlphaOnly(WeightSource):
    """An adapter's alpha without its factors (a hand-made source)."""

    def __init__(self, name):
        self.alpha = (f"lora/{name}/lora_alpha", torch.tensor([2.0]))

    def metadata(self):
        return [TensorMeta.of(*self.alpha)]

    def tensors(self):
        yield self.alpha


def test_adapters_that_do_not_fit_are_refused_before_use():
    async def main():
        engine = AsyncEngine(EngineConfig(model="tiny", seed=1, max_loras=1, max_lora_rank=4))
        base = load_model("tiny", seed=1)
        try:
            before = await engine.fingerprint()
            with pytest.raises(MetadataError) as err:
                await push(engine, LoRASource("big", peft_adapter(base, 8, 0), lora_alpha=8),
                           "x")
            assert "adapter 'big' has rank 8 > max_lora_rank 4: start the engine with " \
                   "--max-lora-rank 8 or more" in str(err.value)
            assert str(err.value).count("max_lora_rank") == 1
            odd = {"base_model.model.model.norm.lora_A.default.weight": torch.zeros(2, 64),
                   "base_model.model.model.norm.lora_B.default.weight": torch.zeros(64, 2)}
            with pytest.raises(MetadataError, match="has no LoRA slots here"):
                await push(engine, LoRASource("odd", odd, lora_alpha=2), "x")
            with pytest.raises(MetadataError, match=r"\['bare'\] come with lora_alpha but no"):
                await push(engine, AlphaOnly("bare"), "x")
            assert await engine.fingerprint() == before
            with pytest.raises(ConfigError, match="unknown LoRA adapter 'nope'"):
                await tokens(engine, "nope")
            await push(engine, LoRASource("one", peft_adapter(base, 2, 0), lora_alpha=2), "1")
            with pytest.raises(MetadataError, match=r"need 1 free slot\(s\); max_loras=1"):
                await push(engine, LoRASource("two", peft_adapter(base, 2, 1), lora_alpha=2),
                           "2")
            assert (await tokens(engine, "one")).weight_versions[0].version == "1"
        finally:
            engine.shutdown()
        with pytest.raises(ConfigError, match="serves no adapters"):
            plain = AsyncEngine(EngineConfig(model="tiny"))
            try:
                await tokens(plain, "one")
            finally:
                plain.shutdown()

    run(main(), deadline_s=240)


def test_a_non_finite_adapter_is_refused_and_fails_no_other_request():
    """An adapter whose factors hold a NaN, or whose alpha is infinite, is refused before any
    request can use it (`NonFiniteError` naming the tensor); requests on the base model and
    on a good adapter, sampled at temperature 1 meanwhile, finish normally."""
    async def main():
        engine = AsyncEngine(EngineConfig(model="tiny", seed=1, max_loras=2, max_lora_rank=4))
        base = load_model("tiny", seed=1)
        try:
            await push(engine, LoRASource("good", peft_adapter(base, 2, 0), lora_alpha=2), "1")
            before = await engine.fingerprint()
            factors = peft_adapter(base, 2, 1)
            poisoned = next(k for k in factors if ".lora_B." in k)
            factors[poisoned][3, 1] = float("nan")
            with pytest.raises(NonFiniteError, match="holds NaN or infinite values"):
                await push(engine, LoRASource("bad", factors, lora_alpha=2), "2")
            with pytest.raises(NonFiniteError, match="'lora/inf/lora_alpha' holds NaN"):
                await push(engine, InfiniteAlpha("inf", peft_adapter(base, 2, 2)), "3")
            with pytest.raises(ConfigError, match="lora_alpha must be finite"):
                LoRASource("x", peft_adapter(base, 2, 2), lora_alpha=float("nan"))
            assert await engine.fingerprint() == before
            with pytest.raises(ConfigError, match="unknown LoRA adapter 'bad'"):
                await tokens(engine, "bad")
            params = [SamplingParams(max_tokens=8, temperature=1.0, seed=i, lora=lora)
                      for i, lora in enumerate((None, "good", None, "good"))]
            outs = await asyncio.gather(*(collect(engine, f"r{i}", PROMPT, p)
                                          for i, p in enumerate(params)))
            assert [o.outputs[0].finish_reason for o in outs] == ["length"] * 4
        finally:
            engine.shutdown()

    run(main(), deadline_s=240)


class InfiniteAlpha(LoRASource):
    """An adapter whose alpha tensor is infinite (a trainer that built the tensor itself)."""

    def __init__(self, name, factors):
        super().__init__(name, factors, lora_alpha=1.0)
        self._alpha = torch.tensor([float("inf")], dtype=torch.float32)


def test_an_adapter_over_nccl_m2n_is_refused_before_any_write_not_dropped():
    """An nccl M->N plan is made once, from what each worker declared at init; adapters are
    named by each update, so no trainer rank would send them: the worker says so (instead of
    serving the update without its adapter), and the next plain nccl update lands."""
    async def main():
        engine = AsyncEngine(EngineConfig(model="tiny", seed=1, max_loras=2, max_lora_rank=8,
                                          weight_transfer_backend="nccl"))
        base = load_model("tiny", seed=1)
        source = LoRASource("math", peft_adapter(base, 4, seed=0), lora_alpha=8)
        try:
            before = await engine.fingerprint()
            m2n = NCCLTrainerInitInfo(master_address="127.0.0.1", world_size=2, timeout_s=20,
                                      bucket_bytes=1 << 16, m2n=True)
            with pytest.raises(MetadataError, match="did not declare when the M->N transfer"):
                sender = await asyncio.to_thread(wtransfer.trainer_init, m2n,
                                                 client=LocalEngineClient(engine), source=source)
                try:
                    await asyncio.to_thread(sender.send_weights, "m1")
                finally:
                    await asyncio.to_thread(sender.shutdown)
            assert await engine.fingerprint() == before
            assert (await engine.weight_info())["adapters"] == {}
            await push(engine, source, "m2", "nccl")
            assert (await engine.weight_info())["adapters"] == {"math": "m2"}
        finally:
            engine.shutdown()

    run(main(), deadline_s=240)


def test_a_base_update_then_an_adapter_update_keeps_each_label_and_in_place_is_refused():
    """The base version stays the base update's after an adapter-only update; a delta-enabled
    sender of an adapter sends it whole every time; an engine updating in place is refused
    at start-up (an adapter update failing there would leave a live slot half written)."""
    async def main():
        engine = AsyncEngine(EngineConfig(model="tiny", seed=1, max_loras=2, max_lora_rank=8,
                                          update_staging="swap"))
        with pytest.raises(ConfigError, match="land in the staging shadow"):
            EngineConfig(model="tiny", seed=1, max_loras=2, update_staging="off")
        base = load_model("tiny", seed=1)
        try:
            await push(engine, wtransfer.ModuleSource(load_model("tiny", seed=2)), "v1")
            source = LoRASource("math", peft_adapter(base, 4, seed=0), lora_alpha=8)
            sender = await asyncio.to_thread(
                wtransfer.trainer_init, IPCTrainerInitInfo(delta=True, timeout_s=60),
                client=LocalEngineClient(engine), source=source)
            for step in range(2):
                stats = await asyncio.to_thread(sender.send_weights, f"m{step}")
                assert stats.wire_bytes == stats.bytes  # adapters always travel whole
            await asyncio.to_thread(sender.shutdown)
            assert await engine.get_weight_version() == "v1"
            assert (await tokens(engine)).weight_versions[0].version == "v1"
            assert (await tokens(engine, "math")).weight_versions[0].version == "m1"
        finally:
            engine.shutdown()

    run(main(), deadline_s=240)


class BaseAndAdapter(WeightSource):
    """A base model's tensors, then an adapter's, in one update."""

    def __init__(self, base, adapter):
        self.parts = (wtransfer.ModuleSource(base), adapter)

    def metadata(self):
        return [meta for part in self.parts for meta in part.metadata()]

    def tensors(self):
        for part in self.parts:
            yield from part.tensors()


def test_one_staged_update_of_base_tensors_and_an_adapter_commits_both():
    """The adapter's slots are written into part of each factor's tensor after the base
    tensors of the same update landed whole: every base tensor goes live as sent (none is
    levelled back to what was live), and the adapter with them."""
    async def main():
        engine = AsyncEngine(EngineConfig(model="tiny", seed=1, max_loras=2, max_lora_rank=8,
                                          update_staging="swap", batch_invariant=True))
        plain = AsyncEngine(EngineConfig(model="tiny", seed=3, batch_invariant=True))
        ref = AsyncEngine(EngineConfig(model="tiny", seed=1, batch_invariant=True))
        adapter = peft_adapter(load_model("tiny", seed=1), 4, seed=0)
        try:
            await push(engine, wtransfer.ModuleSource(load_model("tiny", seed=2)), "v1")
            await push(engine, BaseAndAdapter(load_model("tiny", seed=3),
                                              LoRASource("math", adapter, lora_alpha=8)), "v2")
            assert (await tokens(engine)).token_ids == (await tokens(plain)).token_ids
            await push(ref, wtransfer.ModuleSource(merged(3, adapter, 8, 4)), "merged")
            assert (await tokens(engine, "math")).token_ids == (await tokens(ref)).token_ids
            assert await engine.get_weight_version() == "v2"
        finally:
            for e in (engine, plain, ref):
                e.shutdown()

    run(main(), deadline_s=240)


def test_an_adapter_on_an_fp8_engine_serves_like_its_dequantized_weights_with_the_adapter():
    """max_loras with quantization="fp8": the FP8 projections keep their bytes and the adapter
    (bf16, the checkpoint's dtype) lands in its slots; greedy tokens equal an unquantized
    engine holding the FP8 weights dequantized plus the same adapter, and differ from the FP8
    base; the adapter reads back bit for bit."""
    from wtransfer.quant.fp8 import dequantize, is_quantized, quantize

    async def main():
        lora = dict(max_loras=1, max_lora_rank=8, update_staging="swap", dtype="bfloat16")
        fp8 = AsyncEngine(EngineConfig(model="tiny", seed=1, quantization="fp8", **lora))
        plain = AsyncEngine(EngineConfig(model="tiny", seed=9, **lora))
        base = load_model("tiny", seed=1, dtype="bfloat16")
        try:
            with torch.no_grad():  # what the FP8 engine computes with, as bf16 weights
                for name, weight in base.named_parameters():
                    if is_quantized(name, tuple(weight.shape)):
                        weight.copy_(dequantize(*quantize(weight), torch.bfloat16))
            await push(plain, wtransfer.ModuleSource(base), "dequantized")
            fp8_base = await engine_tokens(fp8)
            factors = {k: v.to(torch.bfloat16) for k, v in peft_adapter(base, 4, 0).items()}
            source = LoRASource("math", factors, lora_alpha=8)
            for engine in (fp8, plain):
                await push(engine, source, "m1")
            with_adapter = await engine_tokens(fp8, "math")
            assert with_adapter == await engine_tokens(plain, "math") != fp8_base
            sent = wtransfer.fingerprint(source.tensors())
            served = await fp8.fingerprint()
            assert {k: served.get(k) for k in sent} == sent
        finally:
            fp8.shutdown()
            plain.shutdown()

    run(main(), deadline_s=240)


async def engine_tokens(engine, lora=None):
    return (await tokens(engine, lora)).token_ids
