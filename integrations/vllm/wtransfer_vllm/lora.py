"""LoRA adapters into vLLM from memory: a vLLM engine started with ``enable_lora=True`` takes
`wtransfer.trainer.lora.LoRASource` updates (``lora/<name>/...`` tensors) and registers each
adapter with the worker's LoRA manager from the received tensors, no file written. A request
then names it with `lora_request(name)` (its id is derived from the name, its path names no
file: vLLM finds the adapter already registered and never reads a path)."""

from __future__ import annotations

import re
import zlib
from collections.abc import Iterable
from typing import Any

import torch

from wtransfer.errors import ConfigError, MetadataError
from wtransfer.packing import TensorMeta

_WIRE = re.compile(r"lora/(?P<adapter>[A-Za-z0-9_.-]{1,64})/(?:(?P<module>.+)\.lora_(?P<ab>[AB])"
                   r"\.weight|(?P<alpha>lora_alpha))")


def adapter_id(name: str) -> int:
    """vLLM's integer id of adapter `name` (stable across processes: a CRC of the name)."""
    return (zlib.crc32(name.encode()) & 0x7FFFFFFF) or 1


def lora_request(name: str) -> Any:
    """The `vllm.lora.request.LoRARequest` that generates with in-memory adapter `name`."""
    from vllm.lora.request import LoRARequest

    return LoRARequest(lora_name=name, lora_int_id=adapter_id(name),
                       lora_path=f"wtransfer://{name}")


def is_adapter_tensor(name: str) -> bool:
    """Whether `name` is an adapter tensor of a `LoRASource` update."""
    return name.startswith("lora/")


class Adapters:
    """The adapter tensors of the open update, registered with vLLM at its finish."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self._open: dict[str, dict[str, torch.Tensor]] = {}
        self._held: dict[str, tuple[dict[str, torch.Tensor], float]] = {}
        """Every adapter received, by name: its factors and alpha."""

    def _manager(self) -> Any:
        manager = getattr(self.model, "lora_manager", None)
        if manager is None:
            raise MetadataError("update refused before any weight changed: it carries LoRA "
                                "adapters, but this vLLM engine serves none; start it with "
                                "enable_lora=True")
        return manager

    def check(self, metas: Iterable[TensorMeta]) -> None:
        """Refuse adapter tensors vLLM cannot serve (no LoRA, a rank above max_lora_rank,
        a name that is not a factor or alpha) before anything is written."""
        metas = list(metas)
        if not metas:
            return
        limit = self._manager().lora_config.max_lora_rank
        problems = []
        for meta in metas:
            parsed = _WIRE.fullmatch(meta.name)
            if parsed is None:
                problems.append(f"{meta.name!r} is not lora/<adapter>/<module>.lora_A|B.weight "
                                "or lora/<adapter>/lora_alpha")
            elif parsed["ab"]:
                rank = meta.shape[0] if parsed["ab"] == "A" else meta.shape[-1]
                if len(meta.shape) != 2 or not 1 <= rank <= limit:
                    problems.append(f"{meta.name!r}: shape {list(meta.shape)}, rank must be "
                                    f"1..{limit} (max_lora_rank)")
        if problems:
            raise MetadataError("update refused before any weight changed: "
                                + "; ".join(problems[:5]))

    def take(self, name: str, tensor: torch.Tensor) -> None:
        """Keep one adapter tensor (a copy on the host) until the update's finish."""
        parsed = _WIRE.fullmatch(name)
        assert parsed is not None  # checked
        self._open.setdefault(parsed["adapter"], {})[name] = tensor.detach().to(
            "cpu", copy=True)

    def register(self) -> list[str]:
        """Register every adapter of the update with vLLM (a new version replaces the old
        one, which vLLM re-activates from the new tensors at its next use); returns them.

        vLLM drops every registered adapter after each weight update (`reset_lora_state`:
        it would load them from disk again); the adapters received here are registered
        again right after (`_keep_across_updates`), so they outlive base-model updates."""
        opened, self._open = self._open, {}
        if not opened:
            return []
        manager = self._manager()
        for adapter, tensors in opened.items():
            alpha = tensors.pop(f"lora/{adapter}/lora_alpha", None)
            if alpha is None:
                raise ConfigError(f"adapter {adapter!r} came without lora/{adapter}/lora_alpha")
            self._held[adapter] = (tensors, float(alpha[0]))
            manager.remove_adapter(adapter_id(adapter))
            manager.add_adapter(self._build(adapter, manager))
        self._keep_across_updates(manager)
        return sorted(opened)

    def _build(self, adapter: str, manager: Any) -> Any:
        """A fresh `LoRAModel` of a held adapter (vLLM merges packed modules in place when
        it is added, so each registration gets its own)."""
        from vllm.lora.lora_model import LoRAModel
        from vllm.lora.peft_helper import PEFTHelper

        tensors, alpha = self._held[adapter]
        peft: dict[str, torch.Tensor] = {}
        modules, rank = set(), 0
        for name, tensor in tensors.items():
            parsed = _WIRE.fullmatch(name)
            assert parsed is not None
            peft[f"base_model.model.{parsed['module']}.lora_{parsed['ab']}.weight"] = (
                tensor.clone())  # vLLM scales packed factors in place when it merges them
            modules.add(parsed["module"].rsplit(".", 1)[-1])
            rank = tensor.shape[0] if parsed["ab"] == "A" else tensor.shape[-1]
        helper = PEFTHelper.from_dict({"r": int(rank), "lora_alpha": alpha,
                                       "target_modules": sorted(modules)})
        return LoRAModel.from_lora_tensors(adapter_id(adapter), peft, helper, device="cpu",
                                           dtype=manager.lora_config.lora_dtype)

    def _keep_across_updates(self, manager: Any) -> None:
        """Once: after vLLM removes every adapter, register the held ones again."""
        if getattr(manager, "_wtransfer_keeps", None) is self:
            return
        remove_all = manager.remove_all_adapters

        def remove_all_then_restore() -> None:
            remove_all()
            for adapter in self._held:
                manager.add_adapter(self._build(adapter, manager))

        manager.remove_all_adapters = remove_all_then_restore
        manager._wtransfer_keeps = self

    def drop(self) -> None:
        """The update failed: nothing of it is registered."""
        self._open = {}
