"""`LoRASource`: only a LoRA adapter's tensors, sent as adapter `name` (see
`wtransfer.inference.updates.lora` for how an engine serves them)."""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Mapping

import torch
from torch import nn

from wtransfer.errors import ConfigError
from wtransfer.packing import TensorMeta
from wtransfer.trainer.source import WeightSource

_ADAPTER = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_FACTOR = re.compile(r"(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?"
                     r"\.weight")
"""A PEFT factor's name: ``base_model.model.<module>.lora_A.<adapter>.weight`` (or without the
PEFT prefix and adapter part)."""


class LoRASource(WeightSource):
    """The ``lora_A`` / ``lora_B`` tensors of `adapters` (a PEFT model, any module, or a
    name -> tensor mapping in PEFT's naming and layout: A [r, in], B [out, r]) and
    `lora_alpha`, as adapter `name`: ``lora/<name>/<module>.lora_A.weight``, ``...lora_B
    .weight`` and ``lora/<name>/lora_alpha``. Nothing of the base model moves."""

    def __init__(self, name: str, adapters: nn.Module | Mapping[str, torch.Tensor], *,
                 lora_alpha: float) -> None:
        if not _ADAPTER.fullmatch(name):
            raise ConfigError(f"adapter name must be 1-64 of [A-Za-z0-9_.-], got {name!r:.80}")
        state = (dict(adapters.named_parameters()) if isinstance(adapters, nn.Module)
                 else dict(adapters))
        self._items: list[tuple[str, torch.Tensor]] = []
        factors: dict[str, set[str]] = {}
        for key, tensor in state.items():
            found = _FACTOR.fullmatch(key)
            if found is None:
                continue
            module, ab = found["module"], found["ab"]
            factors.setdefault(module, set()).add(ab)
            self._items.append((f"lora/{name}/{module}.lora_{ab}.weight", tensor))
        if not self._items:
            raise ConfigError(f"adapter {name!r}: no lora_A / lora_B tensors found")
        lonely = sorted(m for m, seen in factors.items() if seen != {"A", "B"})
        if lonely:
            raise ConfigError(f"adapter {name!r}: {lonely[:3]} lack lora_A or lora_B")
        if not math.isfinite(lora_alpha):
            raise ConfigError(f"adapter {name!r}: lora_alpha must be finite, got {lora_alpha}")
        self._alpha = torch.tensor([float(lora_alpha)], dtype=torch.float32)
        self.name = name

    @property
    def delta_ok(self) -> bool:
        """False: an adapter's slot is rewritten from all of its tensors each update."""
        return False

    def metadata(self) -> list[TensorMeta]:
        """Every factor under its wire name, then the adapter's alpha."""
        return ([TensorMeta.of(n, t) for n, t in self._items]
                + [TensorMeta.of(f"lora/{self.name}/lora_alpha", self._alpha)])

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The factors (detached), then the alpha."""
        for name, tensor in self._items:
            yield name, tensor.detach()
        yield f"lora/{self.name}/lora_alpha", self._alpha

    @property
    def device(self) -> torch.device | None:
        """Where the factors live."""
        return self._items[0][1].device
