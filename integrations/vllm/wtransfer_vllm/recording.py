"""What each vLLM worker keeps of every checkpoint tensor, recorded from its own weight loaders.

A tensor-parallel vLLM worker reads only part of most checkpoint tensors: its rows of a
column-parallel projection, its columns of a row-parallel one, its heads of ``q_proj``,
``k_proj`` and ``v_proj`` (written into the fused ``qkv_proj``), its slice of the vocabulary.
Which part is decided by the model's weight loaders, so rather than a table of names per model
`record_kept` asks them: once, at the first M->N update, every layer is put back into its
loader-facing form on the meta device (what vLLM's layerwise reload recorded when the model was
loaded), and each checkpoint name is handed to ``model.load_weights`` with a meta tensor of its
shape. A dispatch mode watches what the loaders copy out of that probe: the box of every copy
source is read off its view geometry (offset and strides within the probe's storage, which its
views, ``.data`` and ``detach()`` share), and the worker keeps the smallest box that holds all
of them. No byte is read, no in-place op runs on a tensor that is not on the meta device, and
the layers get their own tensors back at the end (the reload's deferring wrappers an earlier
update left on the loader-facing tensors are set aside meanwhile).

Whatever cannot be read off exactly counts as the whole tensor (a copy from a transposed or
reshaped view, an in-place op on the probe, a loader that fails on a meta tensor, a loader that
reports loading a parameter without copying into it): a worker may be sent more than it reads,
never less. A name no loader copies from (a tied ``lm_head``, an expert another rank holds) is
not kept.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from wtransfer.packing import DTYPES, TensorMeta
from wtransfer.records import Box, TensorLayout

log = logging.getLogger("wtransfer.vllm")

_SAME_ORDER = {torch.ops.aten._to_copy.default, torch.ops.aten.clone.default}
"""Ops whose result holds their input's elements in the input's order (casts, copies)."""


def _hull(boxes: list[Box]) -> Box:
    """The smallest box holding every one of `boxes`."""
    dims = range(len(boxes[0].offsets))
    starts = [min(b.offsets[d] for b in boxes) for d in dims]
    ends = [max(b.offsets[d] + b.lengths[d] for b in boxes) for d in dims]
    return Box(offsets=tuple(starts), lengths=tuple(e - s for s, e in zip(starts, ends,
                                                                         strict=True)))


class _Origin:
    """Where the tensors of one storage come from: `tensor` (its elements in its own order)
    is `box` of the probe, element for element when `exact`; otherwise it was made somehow
    out of (only) the elements of `box`."""

    __slots__ = ("box", "exact", "tensor")

    def __init__(self, tensor: torch.Tensor, box: Box, exact: bool) -> None:
        self.tensor, self.box, self.exact = tensor, box, exact


def _storage(tensor: torch.Tensor) -> int | None:
    """Which storage `tensor` views (shared by its views, ``.data`` and ``detach()``)."""
    try:
        return int(tensor.untyped_storage()._cdata)
    except (RuntimeError, NotImplementedError, TypeError):
        return None


class ReadRecorder(TorchDispatchMode):
    """The boxes of `probe` that the code run under this mode copies out of it (see the
    module docstring). Copies out of the probe are not performed, nor is any in-place op on
    a tensor that is not on the meta device (a live weight the loaders could reach)."""

    def __init__(self, probe: torch.Tensor) -> None:
        super().__init__()
        self.shape = tuple(probe.shape)
        self._origins: dict[int, _Origin] = {}
        """By storage, the probe and every new tensor made from it (kept alive, so that no
        other tensor gets the storage's identity)."""
        key = _storage(probe)
        assert key is not None
        self._origins[key] = _Origin(probe, Box.whole(self.shape), exact=True)
        self.boxes: list[Box] = []

    def _locate(self, tensor: torch.Tensor) -> tuple[Box, bool] | None:
        """The box of the probe that `tensor`'s elements come from, and whether they are
        exactly that box in its order (None: not from the probe). Where its place cannot be
        read off exactly, all its origin's box."""
        key = _storage(tensor)
        origin = self._origins.get(key) if key is not None else None
        if origin is None:
            return None
        if not origin.exact:
            return origin.box, False
        placed = _place(tensor, origin.tensor)
        if placed is None:
            return origin.box, False
        return Box(offsets=tuple(o + s for o, s in zip(origin.box.offsets, placed.offsets,
                                                       strict=True)),
                   lengths=placed.lengths), True

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        located = [(t, found) for t in inputs if (found := self._locate(t)) is not None]
        if func._schema.is_mutable:
            if located:  # a copy out of the probe, or the probe fed into a tensor in place
                self.boxes.append(_hull([box for _, (box, _) in located]))
            if located or any(not t.is_meta for t in inputs):
                return args[0]  # not performed: nothing is read, no live tensor written
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        if located and not func.is_view:  # new tensors (views share their storage)
            source, (box, exact) = located[0]
            for made in tree_flatten(out)[0]:
                key = _storage(made) if isinstance(made, torch.Tensor) else None
                if key is None:
                    continue
                same = (exact and func in _SAME_ORDER and len(located) == 1
                        and tuple(made.shape) == tuple(source.shape) and made.is_contiguous())
                self._origins[key] = _Origin(made, box if same else _hull(
                    [b for _, (b, _) in located]), same)
        return out

    def kept(self) -> Box | None:
        """The smallest box holding every read (None: nothing was read)."""
        return _hull(self.boxes) if self.boxes else None


def _place(view: torch.Tensor, root: torch.Tensor) -> Box | None:
    """The box of contiguous `root` that `view` (a view of it) is, if it is one box in
    root's own order (same rank and strides), else None."""
    if (not root.is_contiguous() or view.dim() != root.dim()
            or view.element_size() != root.element_size()):
        return None
    if tuple(view.stride()) != tuple(root.stride()) and view.numel() > 1:
        return None
    offset = int(view.storage_offset()) - int(root.storage_offset())
    starts = []
    for stride, size, limit in zip(root.stride(), view.shape, root.shape, strict=True):
        start, offset = divmod(offset, int(stride)) if stride else (0, offset)
        if start < 0 or start + size > limit:
            return None
        starts.append(start)
    return Box(offsets=tuple(starts), lengths=tuple(view.shape)) if not offset else None


def _kept_of(model: torch.nn.Module, meta: TensorMeta) -> Box | None:
    probe = torch.empty(meta.shape, dtype=DTYPES[meta.dtype], device="meta")
    load: Any = model.load_weights
    recorder = ReadRecorder(probe)
    try:
        with recorder:
            loaded = load([(meta.name, probe)])
    except Exception as exc:  # the loader needs real values: assume it reads everything
        log.debug("recording %s: its loader failed on a meta tensor (%s); kept whole",
                  meta.name, exc)
        return Box.whole(meta.shape)
    box = recorder.kept()
    if box is None and loaded:  # it says it loaded something, yet copied nothing we saw
        return Box.whole(meta.shape)
    return box


@torch.no_grad()
@torch.inference_mode(False)
def record_kept(model: torch.nn.Module, metas: Iterable[TensorMeta]) -> dict[str, TensorLayout]:
    """What `model`'s loaders read of each checkpoint tensor `metas` (see the module
    docstring), as layouts by checkpoint name; names nothing is read of are left out."""
    from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
    from vllm.model_executor.model_loader.reload.meta import restore_layer_on_meta

    saved = [_Saved(layer, get_layerwise_info(layer)) for layer in model.modules()]
    try:
        for entry in saved:
            restore_layer_on_meta(entry.layer, entry.info)
            entry.unwrap_loaders()
        layouts = {}
        for meta in metas:
            with disable_mtp_completeness_check():
                box = _kept_of(model, meta)
            if box is not None:
                layouts[meta.name] = TensorLayout(name=meta.name, dtype=meta.dtype,
                                                  shape=tuple(meta.shape), boxes=(box,))
        return layouts
    finally:
        for entry in saved:
            entry.put_back()


class _Saved:
    """A layer's own tensors (and plain attributes of the names its loader-facing form
    registers), put back exactly after recording."""

    def __init__(self, layer: torch.nn.Module, info: Any) -> None:
        self.layer, self.info = layer, info
        self.params = dict(layer._parameters)
        self.buffers = dict(layer._buffers)
        self.non_persistent = set(layer._non_persistent_buffers_set)
        params, buffers = info.restore_metadata
        self.attributes = {n: layer.__dict__[n] for n in (*params, *buffers)
                           if n in layer.__dict__}
        self._meta_attributes: list[tuple[torch.Tensor, dict[str, Any]]] = []

    def unwrap_loaders(self) -> None:
        """On the loader-facing meta tensors now in the layer (vLLM keeps them for every
        reload): each weight loader as written, not the reload's deferring wrapper an
        earlier update left on it (which copies nothing); their attributes are put back."""
        from vllm.model_executor.model_loader.reload.layerwise import _get_original_loader

        tensors = [*self.layer._parameters.values(), *self.layer._buffers.values()]
        for tensor in tensors:
            if tensor is None or not tensor.is_meta:
                continue
            self._meta_attributes.append((tensor, dict(tensor.__dict__)))
            if hasattr(tensor, "weight_loader"):
                tensor.weight_loader = _get_original_loader(tensor)

    def put_back(self) -> None:
        """The layer as it was before `restore_layer_on_meta`."""
        layer = self.layer
        layer._parameters.clear()
        layer._parameters.update(self.params)
        layer._buffers.clear()
        layer._buffers.update(self.buffers)
        layer._non_persistent_buffers_set = set(self.non_persistent)
        layer.__dict__.update(self.attributes)
        for tensor, attributes in self._meta_attributes:
            tensor.__dict__.clear()
            tensor.__dict__.update(attributes)
