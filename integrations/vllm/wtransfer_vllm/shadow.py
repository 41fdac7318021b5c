"""`Shadow`: a second copy of a vLLM worker's weight-owning layers, loaded by vLLM's own loaders
while the live model keeps generating, and made live between two steps.

The shadow mirrors the model's module tree: every layer that owns checkpoint tensors
(linear, embedding, norm and expert layers) has a twin holding its own copies of the layer's
parameters and buffers; containers are shallow copies whose children are the twins, and
attention layers (which hold the KV-cache binding) are shared. So ``mirror.load_weights``,
the model's own loader, routes every checkpoint tensor into the twins, and vLLM's layerwise
processing (`vllm.model_executor.model_loader.reload.layerwise`) runs on them: a twin is put on
the meta device, buffered, materialized and processed (fused, repacked, quantized, a CPU
GEMM's packed weight captured in its ``cpu_linear``) once all its tensors arrived, exactly as
vLLM's reload processes a live layer, without touching the live one.

Committing exchanges live and twin, layer by layer, for the layers the update loaded:

- ``swap``: the two layers exchange their state (parameters, buffers, and what processing
  left on them, such as ``cpu_linear``), so the live layer object (which the forward context,
  LoRA wrappers and MoE dispatch hold) computes with the new weights and its twin keeps the
  previous ones (a rollback is the same exchange again);
- ``copy``: the twin's tensors are copied into the live layer's own storages (their
  addresses, which captured CUDA graphs read, do not change) and its other state is taken over.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterable
from types import MethodType
from typing import Any, Literal, cast

import torch
from torch import nn

from wtransfer.errors import LifecycleError

log = logging.getLogger("wtransfer.vllm")

CommitMode = Literal["swap", "copy"]
_OWN_STATE = ("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set")
"""A layer's state that `copy` does not take over by reference."""


def _attention(layer: nn.Module) -> bool:
    from vllm.model_executor.layers.attention import is_deferred_attention_layer

    return is_deferred_attention_layer(layer)


def _owns_weights(layer: nn.Module) -> bool:
    """Whether `layer` itself holds checkpoint tensors (parameters, or buffers a checkpoint
    carries), and is not an attention layer."""
    if _attention(layer):
        return False
    persistent = [n for n, b in layer._buffers.items()
                  if b is not None and n not in layer._non_persistent_buffers_set]
    return any(p is not None for p in layer._parameters.values()) or bool(persistent)


def _rebound(tensor: torch.Tensor, old: nn.Module, new: nn.Module) -> torch.Tensor:
    """`tensor`'s attributes that are methods bound to `old` (its weight loader) bound to
    `new` instead."""
    for key, value in tensor.__dict__.items():
        if isinstance(value, MethodType) and value.__self__ is old:
            tensor.__dict__[key] = value.__func__.__get__(new)
    return tensor


def _clone(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of `tensor` with its own storage, of its class and with its attributes."""
    out = torch.empty_strided(tuple(tensor.shape), tuple(tensor.stride()), dtype=tensor.dtype,
                              device=tensor.device)
    out.copy_(tensor.detach())
    out.__class__ = tensor.__class__
    out.__dict__ = tensor.__dict__.copy()
    return out


def _exchange(a: nn.Module, b: nn.Module) -> None:
    """Exchange the whole state of two layers but their children."""
    a_state, b_state = dict(a.__dict__), dict(b.__dict__)
    a_children, b_children = a_state.pop("_modules"), b_state.pop("_modules")
    a.__dict__.clear()
    a.__dict__.update(b_state, _modules=a_children)
    b.__dict__.clear()
    b.__dict__.update(a_state, _modules=b_children)


def _copy_into(live: nn.Module, twin: nn.Module) -> None:
    """Copy the twin's tensors into the live layer's storages (replacing one only where
    processing changed its shape or dtype), and exchange their other state."""
    for slot in ("_parameters", "_buffers"):
        mine, theirs = getattr(live, slot), getattr(twin, slot)
        for name, tensor in theirs.items():
            held = mine.get(name)
            if tensor is None or held is None:
                mine[name] = tensor
            elif held.shape == tensor.shape and held.dtype == tensor.dtype:
                held.data.copy_(tensor.data)
            else:
                mine[name], theirs[name] = tensor, held
    for key in set(live.__dict__) | set(twin.__dict__):
        if key in _OWN_STATE or key.startswith("_forward") or key.startswith("_backward"):
            continue
        if live.__dict__.get(key) is not twin.__dict__.get(key):
            live_value, twin_value = live.__dict__.get(key), twin.__dict__.get(key)
            for layer, value in ((live, twin_value), (twin, live_value)):
                if value is None and key not in layer.__dict__:
                    continue
                layer.__dict__[key] = value


class Shadow:
    """The twins of one worker's weight-owning layers (see the module docstring)."""

    def __init__(self, model: nn.Module, mode: CommitMode = "swap") -> None:
        if mode not in ("swap", "copy"):
            raise LifecycleError(f"shadow commit mode must be 'swap' or 'copy', got {mode!r}")
        self.model = model
        self.mode: CommitMode = mode
        self.pairs: list[tuple[nn.Module, nn.Module]] = []
        """Each weight-owning live layer and its twin."""
        self._tensors: dict[int, torch.Tensor] = {}
        """Twin tensors by the live tensor's id (tied weights stay tied in the shadow)."""
        self.mirror = self._mirror(model, {})
        """The model as its loader sees it, with the twins in place of the live layers."""
        self._tensors = {}
        self.open = False
        """Whether the twins are set up for loading (the first tensor of an update opens)."""
        self.loaded: list[int] = []
        """Indexes in `pairs` of the layers the closed update loaded (what `commit` makes
        live)."""
        self.previous: list[int] | None = None
        """The layers the last swap commit exchanged: their twins hold the version before it,
        until the next update loads into them (None: nothing to swap back)."""

    @property
    def nbytes(self) -> int:
        """Bytes the twins hold now (parameters and buffers; a CPU GEMM's packed weight,
        captured by its ``cpu_linear``, is not counted here)."""
        seen: set[int] = set()
        total = 0
        for _, twin in self.pairs:
            for tensor in (*twin._parameters.values(), *twin._buffers.values()):
                if tensor is not None and id(tensor) not in seen:
                    seen.add(id(tensor))
                    total += tensor.numel() * tensor.element_size()
        return total

    def _mirror(self, module: nn.Module, done: dict[int, nn.Module]) -> nn.Module:
        twin = done.get(id(module))
        if twin is not None:
            return twin
        twin = copy.copy(module)
        done[id(module)] = twin
        if _owns_weights(module):
            twin._parameters = {  # (the clones keep the class: Parameter or vLLM's own)
                n: None if p is None else cast(nn.Parameter, self._twin_tensor(p, module, twin))
                for n, p in module._parameters.items()}
            twin._buffers = {n: None if b is None else self._twin_tensor(b, module, twin)
                             for n, b in module._buffers.items()}
            twin._non_persistent_buffers_set = set(module._non_persistent_buffers_set)
            self.pairs.append((module, twin))
            self._share_reload_record(module, twin)
        twin._modules = {name: None if child is None else self._mirror(child, done)
                         for name, child in module._modules.items()}
        return twin

    def _twin_tensor(self, tensor: torch.Tensor, live: nn.Module, twin: nn.Module
                     ) -> torch.Tensor:
        held = self._tensors.get(id(tensor))
        if held is None:
            held = self._tensors[id(tensor)] = _rebound(_clone(tensor), live, twin)
        return held

    @staticmethod
    def _share_reload_record(live: nn.Module, twin: nn.Module) -> None:
        """Give the twin its own copy of what vLLM recorded about the live layer at load
        (the model-format metadata layerwise processing restores it from)."""
        from vllm.model_executor.model_loader.reload import layerwise
        from vllm.model_executor.model_loader.reload.meta import to_meta_tensor

        record = layerwise.get_layerwise_info(live)
        info = layerwise.get_layerwise_info(twin)
        params, buffers = record.restore_metadata
        info.restore_metadata = ({n: to_meta_tensor(t) for n, t in params.items()},
                                 {n: to_meta_tensor(t) for n, t in buffers.items()})
        info.restore_device = record.restore_device

    def begin(self) -> None:
        """Set every twin up for loading (vLLM's layerwise reload, on the twins only): its
        current tensors become the storage its processed values are copied into."""
        from vllm.model_executor.model_loader.reload import layerwise
        from vllm.model_executor.model_loader.reload.meta import restore_layer_on_meta

        self.previous = None  # the twins are about to hold the new version
        for _, twin in self.pairs:
            info = layerwise.get_layerwise_info(twin)
            if info.can_load():
                continue
            info.kernel_tensors = layerwise.get_layer_params_buffers(twin)
            info.kernel_non_persistent_buffers = set(twin._non_persistent_buffers_set)
            restore_layer_on_meta(twin, info)
            layerwise.initialize_online_processing(twin)
        self.open = True

    def load(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load checkpoint tensors into the twins through the model's own loader (a twin is
        processed as soon as all its tensors arrived)."""
        from vllm.model_executor.model_loader.mtp_validation import (
            disable_mtp_completeness_check,
        )

        if not self.open:
            self.begin()
        load: Any = self.mirror.load_weights  # vLLM models define it; nn.Module does not
        with torch.no_grad(), disable_mtp_completeness_check():
            load(list(weights))

    def close(self, model_config: Any) -> int:
        """Process the twins the update loaded only in part, put back the others' tensors,
        and note which layers it loaded; returns how many."""
        from vllm.model_executor.model_loader.reload import layerwise

        if not self.open:
            self.loaded = []
            return 0
        loaded = []
        for index, (_, twin) in enumerate(self.pairs):
            info = layerwise.get_layerwise_info(twin)
            if not info.can_load() or info.load_numel > 0:  # processed, or to be
                loaded.append(index)
        twins = {id(twin) for _, twin in self.pairs}
        with torch.no_grad():
            for layer in self.mirror.modules():  # (shared layers are not set up: skipped)
                if id(layer) in twins:
                    info = layerwise.get_layerwise_info(layer)
                    if info.can_load():
                        self._finish_layer(layer, info, model_config)
        self.open = False
        self.loaded = loaded
        return len(loaded)

    @staticmethod
    def _finish_layer(layer: nn.Module, info: Any, model_config: Any) -> None:
        from vllm.model_executor.model_loader.reload import layerwise

        if info.load_numel > 0:
            layerwise._layerwise_process(layer, info)  # loaded in part (padding)
        else:
            layerwise._place_kernel_tensors(layer, info)  # not loaded: as it was
            info.reset()

    def discard(self) -> None:
        """Drop a failed update's partial loads: every twin gets its tensors back (the live
        model was never touched)."""
        from vllm.model_executor.model_loader.reload import layerwise

        if not self.open:
            return
        for _, twin in self.pairs:
            info = layerwise.get_layerwise_info(twin)
            if info.can_load():
                if info.kernel_tensors is not None:
                    layerwise._place_kernel_tensors(twin, info)
                info.reset()
        layerwise.LOADING_LAYERS.clear()
        self.open = False
        self.loaded = []

    def commit(self) -> int:
        """Make the layers the closed update loaded live (between two steps: the caller runs
        on the thread that runs the model); returns how many."""
        if self.open:
            raise LifecycleError("the shadow is still loading: close it before committing")
        for index in self.loaded:
            live, twin = self.pairs[index]
            if self.mode == "swap":
                _exchange(live, twin)
            else:
                _copy_into(live, twin)
        self.previous = list(self.loaded) if self.mode == "swap" else None
        committed, self.loaded = len(self.loaded), []
        return committed

    def swap_back(self) -> int:
        """Make the version before the last swap commit live again (its layers' twins still
        hold it); `LifecycleError` when they do not."""
        if self.previous is None:
            raise LifecycleError("no previous version is resident: the last commit copied "
                                 "(mode 'copy'), none happened, or an update has loaded "
                                 "into the twins since")
        for index in self.previous:
            live, twin = self.pairs[index]
            _exchange(live, twin)
        swapped, self.previous = len(self.previous), None
        return swapped
