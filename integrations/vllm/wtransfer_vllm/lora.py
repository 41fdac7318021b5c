"""LoRA adapters into vLLM from memory: a vLLM engine started with ``enable_lora=True`` takes
`wtransfer.trainer.lora.LoRASource` updates (``lora/<name>/...`` tensors) and keeps each
adapter's tensors in the worker, no file written. Its path is ``wtransfer://<name>``: the
worker's adapter loader (`install_path_loader`) builds the adapter from the held tensors for
any request naming that path, whatever id the request carries, so it serves

* in-process engines: a request names it with `lora_request(name)` (an id derived from the
  name);
* ``vllm serve``: the server's model list learns the name once through its
  ``/v1/load_lora_adapter`` route with that path (`ServerClient` does it after the update
  that brought the adapter), and requests name it as their ``model``.

A new version of an adapter unloads every loaded copy of it (under any id), so the next
request loads the new tensors; vLLM dropping adapters (after a weight update, or to make room)
costs a rebuild from memory, never a disk read."""

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


PATH_PREFIX = "wtransfer://"
"""The path of an in-memory adapter: ``wtransfer://<name>``."""


def lora_request(name: str) -> Any:
    """The `vllm.lora.request.LoRARequest` that generates with in-memory adapter `name`."""
    from vllm.lora.request import LoRARequest

    return LoRARequest(lora_name=name, lora_int_id=adapter_id(name),
                       lora_path=PATH_PREFIX + name)


_HELD: dict[str, tuple[dict[str, torch.Tensor], float]] = {}
"""Every adapter this worker process received, by name: its factors and alpha."""
_LOADED: dict[str, set[int]] = {}
"""The vLLM adapter ids each held adapter was loaded under."""


def install_path_loader() -> None:
    """Once per process: vLLM's worker adapter loader builds ``wtransfer://<name>`` adapters
    from the held tensors (any other path loads as vLLM does)."""
    from vllm.lora.worker_manager import WorkerLoRAManager

    if getattr(WorkerLoRAManager, "_wtransfer_loader", False):
        return
    from_disk = WorkerLoRAManager._load_adapter

    def load(self: Any, request: Any) -> Any:
        path = str(request.lora_path or "")
        if not path.startswith(PATH_PREFIX):
            return from_disk(self, request)
        name = path.removeprefix(PATH_PREFIX)
        if name not in _HELD:
            raise ConfigError(f"LoRA adapter {name!r} ({path}) has not been sent to this "
                              f"engine; held: {sorted(_HELD)}")
        _LOADED.setdefault(name, set()).add(int(request.lora_int_id))
        return build_adapter(name, int(request.lora_int_id), self.lora_config.lora_dtype)

    WorkerLoRAManager._load_adapter = load
    WorkerLoRAManager._wtransfer_loader = True


def build_adapter(name: str, lora_id: int, dtype: Any) -> Any:
    """A fresh `LoRAModel` of held adapter `name` under vLLM id `lora_id` (vLLM merges packed
    modules in place when it is added, so each load gets its own tensors)."""
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    tensors, alpha = _HELD[name]
    peft: dict[str, torch.Tensor] = {}
    modules, rank = set(), 0
    for wire_name, tensor in tensors.items():
        parsed = _WIRE.fullmatch(wire_name)
        assert parsed is not None
        peft[f"base_model.model.{parsed['module']}.lora_{parsed['ab']}.weight"] = tensor.clone()
        modules.add(parsed["module"].rsplit(".", 1)[-1])
        rank = tensor.shape[0] if parsed["ab"] == "A" else tensor.shape[-1]
    helper = PEFTHelper.from_dict({"r": int(rank), "lora_alpha": alpha,
                                   "target_modules": sorted(modules)})
    return LoRAModel.from_lora_tensors(lora_id, peft, helper, device="cpu", dtype=dtype)


def is_adapter_tensor(name: str) -> bool:
    """Whether `name` is an adapter tensor of a `LoRASource` update."""
    return name.startswith("lora/")


class Adapters:
    """The adapter tensors of the open update, registered with vLLM at its finish."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self._open: dict[str, dict[str, torch.Tensor]] = {}
        install_path_loader()

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
        """Hold every adapter of the update (a new version replaces the old one) and unload
        every copy of it vLLM has loaded, under any id: the next request that names it loads
        the new tensors through `install_path_loader`. Returns the adapters."""
        opened, self._open = self._open, {}
        if not opened:
            return []
        manager = self._manager()
        for adapter, tensors in opened.items():
            alpha = tensors.pop(f"lora/{adapter}/lora_alpha", None)
            if alpha is None:
                raise ConfigError(f"adapter {adapter!r} came without lora/{adapter}/lora_alpha")
            _HELD[adapter] = (tensors, float(alpha[0]))
            for lora_id in _LOADED.pop(adapter, set()) | {adapter_id(adapter)}:
                manager.remove_adapter(lora_id)
        return sorted(opened)

    def drop(self) -> None:
        """The update failed: nothing of it is registered."""
        self._open = {}
