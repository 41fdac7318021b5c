"""What each vLLM worker keeps of every checkpoint tensor, recorded from its own weight loaders.

A tensor-parallel vLLM worker reads only part of most checkpoint tensors: its rows of a
column-parallel projection, its columns of a row-parallel one, its heads of ``q_proj``,
``k_proj`` and ``v_proj`` (written into the fused ``qkv_proj``), its slice of the vocabulary.
Which part is decided by the model's weight loaders, so rather than a table of names per model
`record_kept` asks them: once, at the first M->N update, every layer is put back into its
loader-facing form on the meta device (what vLLM's layerwise reload recorded when the model was
loaded), and each checkpoint name is handed to ``model.load_weights`` with a meta tensor of its
shape. A dispatch mode watches what the loaders copy out of that probe: the box of every copy
source is read off its view geometry (offset and strides within the probe), and the worker
keeps the smallest box that holds all of them. No byte is read or written and no kernel runs;
the layers get their own tensors back at the end.

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

_COPY = torch.ops.aten.copy_.default
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
    """Where a tensor made from the probe comes from: `box` of it, element for element in
    its order when `exact`; otherwise made somehow out of (only) the elements of `box`."""

    __slots__ = ("box", "exact", "tensor")

    def __init__(self, tensor: torch.Tensor, box: Box, exact: bool) -> None:
        self.tensor, self.box, self.exact = tensor, box, exact


class ReadRecorder(TorchDispatchMode):
    """The boxes of `probe` that the code run under this mode copies out of it (see the
    module docstring). Copies out of the probe are not performed: everything is on meta."""

    def __init__(self, probe: torch.Tensor) -> None:
        super().__init__()
        self.shape = tuple(probe.shape)
        self._origins = {id(probe): _Origin(probe, Box.whole(self.shape), exact=True)}
        """By identity, every tensor made from the probe (kept alive: identities hold)."""
        self.boxes: list[Box] = []

    def _origin(self, tensor: torch.Tensor) -> _Origin | None:
        """The origin of `tensor`, or of the tensor it is a view of (None: not the probe's)."""
        for candidate in (tensor, tensor._base):
            origin = self._origins.get(id(candidate)) if candidate is not None else None
            if origin is not None and origin.tensor is candidate:
                return origin
        return None

    def _box(self, tensor: torch.Tensor) -> Box | None:
        """The box of the probe that `tensor`'s elements come from (None: not the probe's);
        the origin's whole box where its place in it cannot be read off exactly."""
        origin = self._origin(tensor)
        if origin is None:
            return None
        root, box = origin.tensor, origin.box
        if tensor is root or not origin.exact:
            return box
        placed = _place(tensor, root)
        if placed is None:
            return box
        return Box(offsets=tuple(o + s for o, s in zip(box.offsets, placed.offsets,
                                                       strict=True)),
                   lengths=placed.lengths)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is _COPY:
            read = self._box(args[1])
            if read is not None:  # a loader taking its part: noted, not performed
                self.boxes.append(read)
                return args[0]
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        sources = [b for b in map(self._box, inputs) if b is not None]
        if sources and func._schema.is_mutable:  # fed into some tensor in place: anywhere
            self.boxes.append(_hull(sources))
        out = func(*args, **kwargs)
        if sources and not func.is_view and not func._schema.is_mutable:
            exact = func in _SAME_ORDER and len(sources) == 1
            for made in tree_flatten(out)[0]:  # new tensors (views are placed via _base)
                if isinstance(made, torch.Tensor):
                    same = exact and tuple(made.shape) == tuple(inputs[0].shape)
                    self._origins[id(made)] = _Origin(made, _hull(sources), same)
        return out

    def kept(self) -> Box | None:
        """The smallest box holding every read (None: nothing was read)."""
        return _hull(self.boxes) if self.boxes else None


def _place(view: torch.Tensor, root: torch.Tensor) -> Box | None:
    """The box of contiguous `root` that `view` (a view of it) is, if it is one box in
    root's own order (same rank and strides), else None."""
    if not root.is_contiguous() or view.dim() != root.dim():
        return None
    if tuple(view.stride()) != tuple(root.stride()) and view.numel() > 1:
        return None
    offset = int(view.storage_offset()) - int(root.storage_offset())
    starts = []
    for stride, size, limit in zip(root.stride(), view.shape, root.shape, strict=True):
        start, offset = divmod(offset, int(stride)) if stride else (0, offset)
        if start + size > limit:
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
def record_kept(model: torch.nn.Module, metas: Iterable[TensorMeta]) -> dict[str, TensorLayout]:
    """What `model`'s loaders read of each checkpoint tensor `metas` (see the module
    docstring), as layouts by checkpoint name; names nothing is read of are left out."""
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
    from vllm.model_executor.model_loader.reload.meta import restore_layer_on_meta

    saved = [_Saved(layer, get_layerwise_info(layer)) for layer in model.modules()]
    try:
        for entry in saved:
            restore_layer_on_meta(entry.layer, entry.info)
        layouts = {}
        for meta in metas:
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

    def put_back(self) -> None:
        """The layer as it was before `restore_layer_on_meta`."""
        layer = self.layer
        layer._parameters.clear()
        layer._parameters.update(self.params)
        layer._buffers.clear()
        layer._buffers.update(self.buffers)
        layer._non_persistent_buffers_set = set(self.non_persistent)
        layer.__dict__.update(self.attributes)
