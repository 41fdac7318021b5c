"""`Fp8Source`: a trainer's source quantized before it is sent (half the bytes move)."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from wtransfer.packing import TensorMeta
from wtransfer.quant.fp8 import SCALE_SUFFIX, is_quantized, quantize, scale_shape
from wtransfer.trainer.source import WeightSource


class Fp8Source(WeightSource):
    """`inner`'s tensors as an FP8 engine stores them (`wtransfer.quant.fp8`): each quantized
    weight as float8_e4m3fn followed by its float32 block scales (quantized on the trainer's
    device as it is sent), every other tensor unchanged."""

    def __init__(self, inner: WeightSource) -> None:
        self.inner = inner

    def metadata(self) -> list[TensorMeta]:
        """The quantized list: ``X.weight`` (float8_e4m3fn) and ``X.weight_scale_inv``."""
        out = []
        for meta in self.inner.metadata():
            if is_quantized(meta.name, meta.shape):
                out.append(TensorMeta(meta.name, "float8_e4m3fn", meta.shape))
                out.append(TensorMeta(meta.name + SCALE_SUFFIX, "float32",
                                      scale_shape(meta.shape)))
            else:
                out.append(meta)
        return out

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Each tensor, quantized weights as (weight, scales)."""
        for name, tensor in self.inner.tensors():
            if is_quantized(name, tuple(tensor.shape)):
                q, scale = quantize(tensor)
                yield name, q
                yield name + SCALE_SUFFIX, scale
            else:
                yield name, tensor

    @property
    def device(self) -> torch.device | None:
        """As `inner`."""
        return self.inner.device
