"""Models the child processes, tests and benchmarks build by name: a shape list from
`wtransfer.shapes` filled from a seed, (``llm:NAME``) the inference engine's own model, or
(``hf:DIR``) a transformers checkpoint saved in DIR."""

from __future__ import annotations

from torch import nn

from wtransfer.shapes import build_module, model_metas


def build(name: str, seed: int, device: str, fill: str = "random") -> nn.Module:
    """Build model `name` filled from `seed` on `device`: ``llm:NAME`` is the engine's own model
    (drawn on the host: the same values on every device), ``hf:DIR`` a saved transformers model as
    saved (`seed`, `fill` unused); others draw where they live (CPU and CUDA values differ)."""
    if name.startswith("hf:"):
        from transformers import AutoModelForCausalLM  # only for a checkpoint's model

        model: nn.Module = AutoModelForCausalLM.from_pretrained(name[3:])
        return model.to(device).eval()
    if name.startswith("llm:"):
        from wtransfer.inference.model.decoder import load_model  # only for the engine's own model

        return load_model(name[4:], device=device, seed=seed)
    return build_module(model_metas(name), seed, device, fill=fill)
