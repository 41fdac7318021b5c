"""`Fp8Target`: what an FP8 engine's receiver writes through. It takes each quantized weight
either as the trainer holds it (the checkpoint's dtype: quantized here, with the scheme the
engine serves, as soon as the tensor is complete) or already quantized (FP8 with its scales,
from an `Fp8Source`: stored as it arrives); every other tensor passes through."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from functools import partial

import torch

from wtransfer.errors import MetadataError
from wtransfer.packing import DTYPES, TensorMeta
from wtransfer.quant.fp8 import SCALE_SUFFIX, is_quantized, quantize
from wtransfer.receiver.target import WeightTarget
from wtransfer.records import Box, TensorLayout


class Fp8Target(WeightTarget):
    """`inner` (whose quantized weights are FP8, each with ``<name>_scale_inv``) fed by a
    trainer that sends them in the checkpoint's dtype or already quantized."""

    def __init__(self, inner: WeightTarget, checkpoint_dtype: str) -> None:
        self.inner = inner
        self.checkpoint_dtype = checkpoint_dtype
        self.quantized = {m.name for m in inner.metadata()
                          if m.dtype == "float8_e4m3fn" and is_quantized(m.name, m.shape)}
        self._arriving: set[str] = set()
        """Quantized weights the update in progress sends in the checkpoint's dtype."""
        self._scratch: dict[str, torch.Tensor] = {}
        """Their parts this worker keeps, in the checkpoint's dtype, as boxes land in them
        (`region`); quantized into the weights at `finish`."""

    @property
    def stages(self) -> bool:
        """As `inner`."""
        return self.inner.stages

    def metadata(self) -> list[TensorMeta]:
        """What the engine stores (FP8 weights and their scales; the rest as it is)."""
        return self.inner.metadata()

    def check(self, metas: Sequence[TensorMeta]) -> None:
        """A quantized weight may come in the checkpoint's dtype; the rest as stored; an FP8
        weight only together with its scales (they belong to it)."""
        names = {m.name for m in metas}
        stored, alone = [], []
        for meta in metas:
            if meta.name in self.quantized and meta.dtype not in (self.checkpoint_dtype,
                                                                   "float8_e4m3fn"):
                raise MetadataError(f"update refused before any weight changed: {meta.name!r} "
                                    f"sent as {meta.dtype}; this FP8 engine takes it in its "
                                    f"checkpoint dtype {self.checkpoint_dtype} (quantized "
                                    "here) or quantized, float8_e4m3fn with its scales "
                                    "(Fp8Source): cast the trainer's copy or serve with "
                                    f"--dtype {meta.dtype}")
            weight = meta.name.removesuffix(SCALE_SUFFIX)
            if weight != meta.name and weight in self.quantized and weight not in names:
                raise MetadataError(f"update refused before any weight changed: scales "
                                    f"{meta.name!r} without their FP8 weight {weight!r} (a "
                                    "scale alone would change the weight it scales); send "
                                    "both (Fp8Source)")
            if meta.name in self.quantized and meta.dtype == self.checkpoint_dtype:
                held = self.inner.held(meta.name)
                if held is None or held.shape != meta.shape:
                    raise MetadataError(f"update refused before any weight changed: "
                                        f"{meta.name!r} sent {meta.dtype}{list(meta.shape)}, "
                                        f"engine holds {held.shape if held else 'nothing'}")
                continue
            if meta.name in self.quantized and meta.name + SCALE_SUFFIX not in names:
                alone.append(meta.name)
            stored.append(meta)
        if alone:
            raise MetadataError(f"update refused before any weight changed: FP8 weights "
                                f"without their scales ({SCALE_SUFFIX}): {alone[:3]}; send "
                                "both (Fp8Source)")
        self.inner.check(stored)
        self._arriving = {m.name for m in metas if m.name in self.quantized
                          and m.dtype == self.checkpoint_dtype}
        self._scratch = {}

    def held(self, name: str) -> TensorMeta | None:
        """As `inner`."""
        return self.inner.held(name)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Quantize quantized weights that arrive unquantized (a tensor-parallel worker only
        its part: `_quantize_part`); store everything else."""
        out: list[tuple[str, torch.Tensor]] = []
        for name, tensor in weights:
            if name in self.quantized and tensor.dtype != torch.float8_e4m3fn:
                if not self._quantize_part(name, tensor):
                    q, scale = quantize(tensor)
                    out += [(name, q), (name + SCALE_SUFFIX, scale)]
            else:
                out.append((name, tensor))
        self.inner.load_weights(out)

    def _quantize_part(self, name: str, full: torch.Tensor) -> bool:
        """Quantize only the boxes of `name` this worker keeps (whole 128 x 128 blocks) and write
        them and their scales in place: the full tensor's bytes at 1/N of the work. An M->N
        update fills only these parts of `full`. False when the worker holds `name` whole."""
        kept = self.inner.keeps()
        layout = kept.get(name) if kept is not None else None
        scales = kept.get(name + SCALE_SUFFIX) if kept is not None else None
        if layout is None or scales is None or layout.is_whole or \
                len(layout.boxes) != len(scales.boxes):
            return False
        self._store_boxes(name, lambda box: full[box.slices()])
        return True

    def _store_boxes(self, name: str, part: Callable[[Box], torch.Tensor]) -> None:
        """Quantize each box this worker keeps of `name` (`part(box)`: its values in the
        checkpoint's dtype) and write it and its scales in place."""
        kept = self.inner.keeps()
        assert kept is not None  # only for a worker that keeps boxes
        layout, scales = kept[name], kept[name + SCALE_SUFFIX]
        for box, scale_box in zip(layout.boxes, scales.boxes, strict=True):
            q, scale = quantize(part(box))
            weight_view = self.inner.region(name, box)
            scale_view = self.inner.region(name + SCALE_SUFFIX, scale_box)
            if weight_view is None or scale_view is None or scale_view.shape != scale.shape:
                raise MetadataError(f"{name!r}: this worker's part does not hold whole "
                                    f"{list(scale.shape)} blocks of scales")
            weight_view.copy_(q)
            scale_view.copy_(scale)

    def direct_bytes(self, name: str) -> torch.Tensor | None:
        """None for quantized weights and their scales (a weight may arrive in another dtype and
        is quantized with them: each goes through `load_weights`); `inner`'s view of the
        rest."""
        return None if self._paired(name) else self.inner.direct_bytes(name)

    def _paired(self, name: str) -> bool:
        return name in self.quantized or name.removesuffix(SCALE_SUFFIX) in self.quantized

    def keeps(self) -> dict[str, TensorLayout] | None:
        """As `inner`."""
        return self.inner.keeps()

    def region(self, name: str, box: Box) -> torch.Tensor | None:
        """Where a box of `name` lands (M->N pieces): a quantized weight sent in the
        checkpoint's dtype into a buffer of just the parts this worker keeps, quantized at
        `finish` (a worker never holds a full-shaped copy of a weight it keeps a part of);
        FP8 weights and scales sent as stored, and everything else, into `inner`'s region."""
        if name not in self._arriving:
            return self.inner.region(name, box)
        kept = self.inner.keeps()
        layout = kept.get(name) if kept is not None else None
        if layout is None:
            return None  # assembled whole, then quantized in `load_weights`
        scratch = self._scratch.get(name)
        if scratch is None:
            live = self.inner.region(name, layout.boxes[0])
            if live is None:
                return None  # assembled whole, then quantized in `load_weights`
            scratch = self._scratch[name] = torch.empty(
                layout.local_shape, dtype=DTYPES[self.checkpoint_dtype], device=live.device)
        return layout.view(scratch, box)

    def companions(self, name: str) -> list[str]:
        """A quantized weight's scales (writing it in the checkpoint dtype rewrites them),
        and a scale's weight (a new scale changes what the weight stands for)."""
        if name in self.quantized:
            return [name + SCALE_SUFFIX]
        weight = name.removesuffix(SCALE_SUFFIX)
        return [weight] if weight != name and weight in self.quantized else []

    def snapshot(self, name: str, out: torch.Tensor | None = None) -> torch.Tensor | None:
        """As `inner` (what it stores: FP8 weights, scales)."""
        return self.inner.snapshot(name, out)

    def restore(self, saved: Iterable[tuple[str, torch.Tensor]]) -> None:
        """As `inner` (its snapshots go back to it)."""
        self.inner.restore(saved)

    @torch.no_grad()
    def finish(self) -> None:
        """Quantize the parts that landed in the checkpoint's dtype (`region`) into this
        worker's FP8 weights and scales, box by box; then as `inner`."""
        kept = self.inner.keeps() if self._scratch else None
        for name, scratch in self._scratch.items():
            assert kept is not None
            self._store_boxes(name, partial(kept[name].view, scratch))
        self._scratch, self._arriving = {}, set()
        self.inner.finish()

    def patching(self) -> None:
        """As `inner`."""
        self.inner.patching()

    def abort(self) -> None:
        """Drop the parts that landed unquantized; then as `inner`."""
        self._scratch, self._arriving = {}, set()
        self.inner.abort()

    def fingerprint(self) -> dict[str, str]:
        """As `inner` (the FP8 weights and their scales)."""
        return self.inner.fingerprint()
