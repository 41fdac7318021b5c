"""Trainer-side weight sources: what to send, described before it is materialized."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping
from typing import Any, cast

import torch
from torch import nn

from wtransfer.errors import ConfigError
from wtransfer.packing import TensorMeta, is_dtensor, signature
from wtransfer.records import TensorLayout


class WeightSource(ABC):
    """Something that can announce its tensors and then yield them, in the announced order."""

    @abstractmethod
    def metadata(self) -> list[TensorMeta]:
        """Name, dtype and shape of every tensor to send, without materializing any."""

    @abstractmethod
    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(name, tensor)`` in the order of `metadata()`; each may be freed after use."""

    @property
    def device(self) -> torch.device | None:
        """Where the tensors live (senders put staging there); None when unknown."""
        return None

    @property
    def sharded(self) -> bool:
        """Whether the tensors are spread over trainer ranks (DTensors): then every rank sends
        together and full tensors are gathered bucket by bucket (`parts`)."""
        return False

    def parts(self) -> list[torch.Tensor]:
        """The tensors as this rank holds them (DTensors for sharded ones), in the order of
        `metadata()`, without gathering anything; only sharded sources need it."""
        raise NotImplementedError(f"{type(self).__name__} is not a sharded source")

    def layouts(self, replica: int) -> dict[str, TensorLayout]:
        """What this rank holds of each tensor, by name, without moving or computing any:
        a sharded source's boxes (from its parts' placements), else every tensor whole;
        `replica` numbers this rank among the ranks holding a tensor whole."""
        from wtransfer.trainer.layouts import LocalShards  # (it builds on the sources)

        if self.sharded:
            return LocalShards(self.metadata(), self.parts(), replica).layouts
        return {m.name: TensorLayout.whole(m.name, m.dtype, m.shape, replica=replica)
                for m in self.metadata()}

    @property
    def delta_ok(self) -> bool:
        """Whether a delta of this source (only its changed tensors or elements) says the same
        as the source itself; False for one whose every update must travel whole (a LoRA
        adapter's slot is rewritten from all of its tensors)."""
        return True

    def read_in_place(self) -> None:
        """Called once by a sender that reads the tensors where they lie, update after update
        (zero-copy CUDA IPC): a source that makes its tensors as it yields them (`Fp8Source`)
        may then make them in buffers it reuses, so their storages stay the same. Optional."""
        return None

    def held(self) -> list[torch.Tensor] | None:
        """Every tensor as the source holds it, in `metadata()`'s order and matching it, to be read
        in place and never written (zero-copy CUDA IPC); None when the source cannot promise that,
        and a sender then walks `tensors()`, checking each against the metadata."""
        return None


def _unique_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """The module's state dict without aliases (tied weights appear once, first name wins)."""
    seen: set[int] = set()
    out: dict[str, torch.Tensor] = {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        key = id(tensor)
        if key not in seen:
            seen.add(key)
            out[name] = tensor
    return out


class ModuleSource(WeightSource):
    """Sends an `nn.Module`'s parameters and persistent buffers (tied weights once); `names`
    restricts it to a subset, `name_map` renames (trainer name -> engine name). DTensor (FSDP2)
    parameters go with their global shape, gathered bucket by bucket as every rank sends."""

    def __init__(
        self,
        module: nn.Module,
        *,
        names: list[str] | None = None,
        name_map: Mapping[str, str] | Callable[[str], str] | None = None,
    ) -> None:
        state = _unique_state(module)
        if names is not None:
            missing = [n for n in names if n not in state]
            if missing:
                raise ConfigError(f"ModuleSource: names not in the module: {missing[:5]}")
            state = {n: state[n] for n in names}
        self._state = state
        self._sharded = any(is_dtensor(t) for t in state.values())
        self._metas: list[TensorMeta] | None = None
        self._signature: tuple[list[torch.Size], list[torch.dtype]] = ([], [])
        """`packing.signature` of the tensors when `_metas` was built (a trainer asks for the
        metadata every step)."""
        self._rename: Callable[[str], str] = (
            (lambda n: name_map.get(n, n)) if isinstance(name_map, Mapping)
            else name_map if name_map is not None else (lambda n: n)
        )  # fmt: skip

    @property
    def device(self) -> torch.device | None:
        """Device of the first tensor (the local device for DTensors)."""
        return next((t.device for t in self._state.values()), None)

    @property
    def sharded(self) -> bool:
        """Whether any tensor is a DTensor (FSDP2 and other sharded models)."""
        return self._sharded

    def parts(self) -> list[torch.Tensor]:
        """Each tensor as this rank holds it (DTensors stay sharded), detached."""
        return [t.detach() for t in self._state.values()]

    def held(self) -> list[torch.Tensor] | None:
        """The module's own tensors (the ones `metadata()` describes), unless sharded."""
        return None if self._sharded else list(self._state.values())

    def metadata(self) -> list[TensorMeta]:
        """Metadata of every tensor, global shapes for DTensors (remembered, and built again
        only when a tensor's shape or dtype changed: a trainer asks every step)."""
        now = signature(self._state.values())
        if self._metas is None or now != self._signature:
            self._metas = [TensorMeta.of(self._rename(n), t) for n, t in self._state.items()]
            self._signature = now
        return list(self._metas)

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield detached tensors; DTensors are gathered to full tensors one at a time."""
        for name, tensor in self._state.items():
            if self._sharded and is_dtensor(tensor):
                tensor = cast(Any, tensor).full_tensor()
            yield self._rename(name), tensor.detach()
