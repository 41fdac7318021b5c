"""`VLLMTarget`: where received weights land inside a vLLM worker.

What the engine accepts is the checkpoint it was started from (names, shapes and dtypes read
from the safetensors headers: no per-model name tables), so an update is checked before any
byte is written. Weights land through vLLM's own loader under layerwise reload, so fused and
quantized layers get the same processing as at start-up. Layerwise reload starts only once the
first tensors arrive, after the manifest was accepted: a refused update never touches the
model. `fingerprint()` digests, by checkpoint name, what the engine received (or loaded from
the checkpoint, for names no update has sent yet).

In an M->N transfer a tensor-parallel worker is sent only what its loaders read
(`keeps`, recorded once from the loaders themselves: `wtransfer_vllm.recording`); the receiver
assembles each tensor's kept box in a tensor of the full shape and vLLM's loader reads its part
of it. Such an update's digests are of the kept boxes, named `wtransfer.fingerprint.part_name`.
"""

from __future__ import annotations

import glob
import logging
import os
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from safetensors import safe_open

from wtransfer.errors import ConfigError, LifecycleError, MetadataError
from wtransfer.fingerprint import part_name, tensor_digest
from wtransfer.packing import DTYPES, TensorMeta
from wtransfer.receiver.target import WeightTarget
from wtransfer.records import TensorLayout
from wtransfer_vllm.lora import Adapters, is_adapter_tensor
from wtransfer_vllm.recording import record_kept

log = logging.getLogger("wtransfer.vllm")

_SAFETENSORS_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
    "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
}


def checkpoint_files(model: str, revision: str | None = None) -> list[str]:
    """The safetensors files of the checkpoint vLLM loaded (a directory, or a hub id already
    in the local cache)."""
    directory = model
    if not os.path.isdir(directory):
        try:
            from huggingface_hub import snapshot_download

            directory = snapshot_download(model, revision=revision, local_files_only=True,
                                          allow_patterns=["*.safetensors"])
        except Exception as exc:
            raise ConfigError(f"wtransfer-vllm: cannot find the checkpoint files of "
                              f"{model!r} locally ({exc})") from None
    files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    if not files:
        raise ConfigError(f"wtransfer-vllm: {directory} holds no *.safetensors; wtransfer reads "
                          "the checkpoint's tensor list to check updates before writing")
    return files


def read_manifest(files: Sequence[str]) -> dict[str, TensorMeta]:
    """Name, dtype and shape of every tensor of the checkpoint (headers only)."""
    manifest: dict[str, TensorMeta] = {}
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                piece = f.get_slice(name)
                dtype = _SAFETENSORS_DTYPES.get(piece.get_dtype())
                if dtype is None:
                    raise ConfigError(f"{path}: tensor {name!r} has dtype {piece.get_dtype()}, "
                                      "which wtransfer does not move")
                manifest[name] = TensorMeta(name, dtype, tuple(piece.get_shape()))
    return manifest


def _floating(dtype: str) -> bool:
    return DTYPES[dtype].is_floating_point


class VLLMTarget(WeightTarget):
    """A vLLM worker's model as a wtransfer `WeightTarget` (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, model_config: Any) -> None:
        self.model = model
        self.model_config = model_config
        self._files = checkpoint_files(model_config.model, getattr(model_config, "revision",
                                                                   None))
        self._manifest = read_manifest(self._files)
        self._checkpoint_digests: dict[str, str] = {}
        """Digests of checkpoint tensors (or of their kept parts), by fingerprint key."""
        self._committed: dict[str, tuple[str, str]] = {}
        """By checkpoint name, how completed updates named the digest of what they delivered
        (the name, or the `part_name` of the part kept) and the digest."""
        self._received: dict[str, tuple[str, str]] = {}
        """The same for what the open update delivered so far."""
        self._kept: dict[str, TensorLayout] | None = None
        """What this worker's loaders read of each checkpoint tensor (recorded once)."""
        self._announced: dict[str, TensorLayout] = {}
        """The open update's adapter tensors, whole (kept whole: an adapter is not split)."""
        self._parts = False
        """Whether the open update delivers only what `keeps` says (an M->N update)."""
        self._parts_landed = False
        """Whether the last update that landed was such an update."""
        self._reloading = False
        self._before: tuple[dict[str, tuple[str, str]], bool] = ({}, False)
        """What `fingerprint` reported before the last update landed (for a swap back)."""
        self.adapters = Adapters(model)
        """LoRA adapters an update carries (`wtransfer_vllm.lora`): registered at finish."""

    @property
    def takes_deltas(self) -> bool:
        """False: vLLM's layerwise reload rebuilds a fused module from what one update sent,
        so an update of only the changed tensors would leave the others uninitialized."""
        return False

    def metadata(self) -> list[TensorMeta]:
        """The checkpoint's tensors."""
        return list(self._manifest.values())

    def held(self, name: str) -> TensorMeta | None:
        """The checkpoint's entry for `name`."""
        return self._manifest.get(name)

    def check(self, metas: Sequence[TensorMeta]) -> None:
        """Names and shapes must match the checkpoint; a floating-point tensor may come in
        another floating-point dtype (vLLM's loader casts), any other dtype must match."""
        self.adapters.check(m for m in metas if is_adapter_tensor(m.name))
        self._parts = False  # until the receiver asks what this worker keeps
        self._announced.update({m.name: TensorLayout.whole(m.name, m.dtype, m.shape)
                                for m in metas if is_adapter_tensor(m.name)})
        problems = []
        for meta in metas:
            if is_adapter_tensor(meta.name):
                continue
            have = self._manifest.get(meta.name)
            if have is None:
                problems.append(f"unknown tensor {meta.name!r}")
            elif have.shape != meta.shape or (have.dtype != meta.dtype and not (
                    _floating(have.dtype) and _floating(meta.dtype))):
                problems.append(f"{meta.name!r}: sent {meta.dtype}{list(meta.shape)}, the "
                                f"checkpoint holds {have.dtype}{list(have.shape)}")
        if problems:
            more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
            raise MetadataError("update refused before any weight changed: "
                                + "; ".join(problems[:5]) + more)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Hand the tensors to vLLM's loader (copies: it may hold them until their layer is
        complete, and ours are views of staging memory)."""
        from vllm.model_executor.model_loader.mtp_validation import (
            disable_mtp_completeness_check,
        )
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        batch = [(name, tensor.clone()) for name, tensor in weights if self.note(name, tensor)]
        if not batch:
            return
        if not self._reloading:
            initialize_layerwise_reload(self.model)
            self._reloading = True
        load: Any = self.model.load_weights  # vLLM models define it; nn.Module does not
        with disable_mtp_completeness_check():
            load(batch)

    def note(self, name: str, tensor: torch.Tensor) -> bool:
        """Record what arrived of `name` (its digest; an adapter tensor is taken in memory);
        True for a checkpoint tensor, which still has to reach the model."""
        self._received[name] = self._digest(name, tensor)
        if is_adapter_tensor(name):
            self.adapters.take(name, tensor)
            return False
        return True

    def keeps(self) -> dict[str, TensorLayout]:
        """What this worker's weight loaders read of each checkpoint tensor, recorded at the
        first call (`wtransfer_vllm.recording`), and the open update's adapter tensors whole;
        an M->N transfer sends this worker only that."""
        if self._kept is None:
            if self._reloading:  # the layers are vLLM's reload placeholders, not the model
                raise LifecycleError("wtransfer-vllm: what this worker keeps is recorded "
                                     "before an update writes any tensor; this one already "
                                     "wrote some")
            self._kept = record_kept(self.model, self._manifest.values())
            log.info("wtransfer-vllm: this worker's loaders read %d of the checkpoint's %d "
                     "bytes (%d of %d tensors, %d of them whole)", self.kept_bytes(),
                     sum(m.nbytes for m in self._manifest.values()),
                     len(self._kept), len(self._manifest),
                     sum(lay.is_whole for lay in self._kept.values()))
        self._parts = True
        return {**self._kept, **self._announced}

    def kept_bytes(self) -> int | None:
        """Bytes of the checkpoint this worker keeps (None until `keeps` recorded them)."""
        if self._kept is None:
            return None
        return sum(lay.nbytes for lay in self._kept.values())

    def _part(self, name: str, parts: bool) -> TensorLayout | None:
        """What this worker keeps of `name` where it keeps only a part of it and `parts` (an
        M->N update) says only that part counts; else None (the whole tensor)."""
        layout = self._kept.get(name) if parts and self._kept is not None else None
        return None if layout is None or layout.is_whole else layout

    def _key(self, name: str, parts: bool) -> str:
        """The fingerprint key of `name`: a `part_name` where only a part of it is kept."""
        layout = self._part(name, parts)
        return name if layout is None else part_name(name, layout.boxes[0])

    def _digest(self, name: str, tensor: torch.Tensor) -> tuple[str, str]:
        """The key and digest of what arrived of `name` (only its kept box, in M->N)."""
        layout = self._part(name, self._parts)
        return self._key(name, self._parts), tensor_digest(
            tensor if layout is None else layout.take(tensor))

    def finish(self) -> None:
        """Let vLLM process the layers still pending, then record what this update sent."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        if self._reloading:
            finalize_layerwise_reload(self.model, self.model_config)
            self._reloading = False
        self.landed()

    def landed(self) -> None:
        """The update is live: its adapters are registered and what it delivered is what
        `fingerprint` reports."""
        self.adapters.register()
        self._before = (dict(self._committed), self._parts_landed)
        if self._received:
            self._parts_landed = any(key != name for name, (key, _) in self._received.items())
        self._committed.update(self._received)
        self._received, self._announced = {}, {}

    def restored(self) -> None:
        """The version before the last update is live again (a staged engine swapped it
        back): `fingerprint` reports it."""
        self._committed, self._parts_landed = self._before[0], self._before[1]

    def dropped(self) -> None:
        """The open update failed: what it delivered is forgotten."""
        self._received, self._announced = {}, {}
        self.adapters.drop()

    def abort(self) -> None:
        """Put the kept kernel tensors back into every layer the failed update left
        incomplete, so the model is whole again (layers already completed keep their new
        weights: the receiver reports the update as torn)."""
        self.dropped()
        if not self._reloading:
            return
        from vllm.model_executor.model_loader.reload import layerwise

        for layer in self.model.modules():
            info = layerwise.get_layerwise_info(layer)
            if info.can_load():
                if info.kernel_tensors is not None:
                    layerwise._place_kernel_tensors(layer, info)
                info.reset()
        layerwise.LOADING_LAYERS.clear()
        if hasattr(self.model, "_original_do_torchao_reload"):
            self.model._do_torchao_reload = self.model._original_do_torchao_reload
        self._reloading = False

    def fingerprint(self) -> dict[str, str]:
        """Digest of every checkpoint tensor as the last update that sent it delivered it,
        else as the checkpoint holds it; while the last update was M->N, checkpoint tensors no
        update sent are digested as that update would have: their kept part (`part_name`),
        or left out where this worker keeps none of them."""
        parts = self._parts_landed
        out = {key: digest for key, digest in self._committed.values()}
        missing = {n for n in self._manifest if n not in self._committed
                   and not (parts and self._kept is not None and n not in self._kept)}
        for path in self._files:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                    if name not in missing:
                        continue
                    key = self._key(name, parts)
                    if key not in self._checkpoint_digests:
                        layout = self._part(name, parts)
                        piece = (f.get_tensor(name) if layout is None else
                                 f.get_slice(name)[layout.boxes[0].slices()])
                        self._checkpoint_digests[key] = tensor_digest(piece)
                    out[key] = self._checkpoint_digests[key]
        return out
