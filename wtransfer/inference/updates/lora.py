"""LoRA adapters served unmerged (`EngineConfig(max_loras=K, max_lora_rank=R)`): which adapter
is in which slot, and the target that writes an adapter's tensors into its slot.

Each attention and MLP projection becomes a `LoRALinear` (a `LoRAFp8Linear` on an FP8 engine;
`wtransfer.inference.model.lora_layers`): its base weight plus K adapter slots, zero where no
adapter is loaded. The slots are ordinary tensors of the module, so staged updates (a shadow of
every tensor), rollback and fingerprints cover them.

On the wire an adapter is its own tensors (`wtransfer.trainer.lora.LoRASource`):
``lora/<adapter>/<module>.lora_A.weight`` [r, in], ``lora/<adapter>/<module>.lora_B.weight``
[out, r] and ``lora/<adapter>/lora_alpha`` (one float32). `LoRATarget` writes them into the
adapter's slot (a new adapter takes a free one), padding r up to R with zeros; the adapter
serves requests once the update committed, labelled with the update's version.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from wtransfer.errors import ConfigError, MetadataError
from wtransfer.fingerprint import tensor_digest
from wtransfer.inference.model.lora_layers import (  # (the layers, importable from here
    TARGET_MODULES,  # as before they moved to model/)
    LoRAFp8Linear,
    LoRALinear,
    LoRARows,
    LoRASlots,
    enable_lora,
)
from wtransfer.packing import TensorMeta
from wtransfer.receiver.target import WeightTarget
from wtransfer.records import Box, TensorLayout

__all__ = ["ADAPTER_NAME", "TARGET_MODULES", "Adapter", "AdapterTable", "LoRAFp8Linear",
           "LoRALinear", "LoRARows", "LoRASlots", "LoRATarget", "adapter_fingerprint",
           "enable_lora"]

ADAPTER_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_WIRE = re.compile(r"lora/(?P<adapter>[^/]+)/(?:(?P<module>.+)\.lora_(?P<ab>[AB])\.weight"
                   r"|(?P<alpha>lora_alpha))")


@dataclass
class Adapter:
    """A served adapter: its slot, version label, and what its last update wrote (rank,
    alpha, target modules), from which its fingerprint is read back out of the slot."""

    slot: int
    version: str
    rank: int = 0
    alpha: float = 0.0
    modules: tuple[str, ...] = field(default_factory=tuple)


class AdapterTable:
    """Which adapter is in which slot: `live` (requests may name them) and what the open update
    writes (`staged`, live once it commits)."""

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self.live: dict[str, Adapter] = {}
        self.staged: dict[str, Adapter] = {}

    def slot_for(self, adapter: str) -> int:
        """The slot the open update writes `adapter` into (its own, or a free one)."""
        staged = self.staged.get(adapter)
        if staged is not None:
            return staged.slot
        live = self.live.get(adapter)
        if live is not None:  # a new version of a served adapter: its own slot
            self.staged[adapter] = Adapter(live.slot, "")
            return live.slot
        taken = {a.slot for a in (*self.live.values(), *self.staged.values())}
        free = [s for s in range(self.slots) if s not in taken]
        if not free:
            raise ConfigError(f"adapter {adapter!r}: all max_loras={self.slots} slots hold "
                              f"adapters ({sorted(self.live)}); start the engine with more")
        self.staged[adapter] = Adapter(free[0], "")
        return free[0]

    def commit(self, version: str | None) -> list[str]:
        """The open update landed: its adapters are live (labelled `version`); returns them."""
        names = sorted(self.staged)
        for name in names:
            adapter = self.staged[name]
            adapter.version = version or (self.live[name].version if name in self.live
                                          else "default")
            self.live[name] = adapter
        self.staged = {}
        return names

    def drop(self) -> None:
        """The open update failed: what it staged is not served."""
        self.staged = {}

    def slot(self, adapter: str | None) -> int:
        """The live slot of `adapter` (-1 for None: the base model)."""
        if adapter is None:
            return -1
        held = self.live.get(adapter)
        if held is None:
            raise ConfigError(f"unknown LoRA adapter {adapter!r}; loaded: {sorted(self.live)}")
        return held.slot


class LoRATarget(WeightTarget):
    """`inner` (a worker's target) that also takes adapter tensors (see the module docstring).
    Tensors of the base model pass through; an update may carry both."""

    def __init__(self, inner: WeightTarget, table: AdapterTable, rank: int) -> None:
        self.inner = inner
        self.table = table
        self.rank = rank
        self._modules = {m.name.removesuffix(".lora_A"): m for m in inner.metadata()
                         if m.name.endswith(".lora_A")}
        self._cleared: set[int] = set()
        self._alpha: dict[int, float] = {}
        self._ranks: dict[int, int] = {}
        self._written: dict[int, set[str]] = {}
        """Per slot: the modules the open update wrote factors of."""
        self._announced: dict[str, TensorLayout] = {}
        """The open update's adapter tensors, whole (what an M->N transfer must send)."""
        self._base_written = False

    def take_base_written(self) -> bool:
        """Whether the update that just landed wrote base-model tensors (then forgotten)."""
        written, self._base_written = self._base_written, False
        return written

    @property
    def stages(self) -> bool:
        """As `inner`."""
        return self.inner.stages

    def metadata(self) -> list[TensorMeta]:
        """The base model's tensors (adapters are named by the update: `check`)."""
        return [m for m in self.inner.metadata() if ".lora_" not in m.name]

    def check(self, metas: Sequence[TensorMeta]) -> None:
        """Base tensors as `inner` checks them; adapter tensors against the LoRA modules: a
        known module, ranks within `max_lora_rank`, one rank per adapter, alpha present."""
        base = [m for m in metas if not m.name.startswith("lora/")]
        problems: list[str] = []
        ranks: dict[str, set[int]] = {}
        alphas: set[str] = set()
        for meta in metas:
            if not meta.name.startswith("lora/"):
                continue
            parsed = _WIRE.fullmatch(meta.name)
            if parsed is None or not ADAPTER_NAME.fullmatch(parsed["adapter"]):
                problems.append(f"{meta.name!r} is not lora/<adapter>/<module>.lora_A|B.weight "
                                "or lora/<adapter>/lora_alpha")
                continue
            adapter = parsed["adapter"]
            self._announced[meta.name] = TensorLayout.whole(meta.name, meta.dtype, meta.shape)
            if parsed["alpha"]:
                if meta.shape != (1,) or meta.dtype != "float32":
                    problems.append(f"{meta.name!r} must be one float32")
                alphas.add(adapter)
                continue
            problems += self._check_factor(meta, parsed["module"], parsed["ab"], ranks, adapter)
        if ranks and not self.stages:
            problems.append("adapter updates land in the staging shadow (a failed one must not "
                            "leave a live adapter half written): start the engine with "
                            "update_staging='swap' or 'copy'")
        bare = sorted(alphas - set(ranks))
        if bare:
            problems.append(f"adapters {bare} come with lora_alpha but no lora_A / lora_B "
                            "factors")
        new = [a for a in ranks if a not in self.table.live and a not in self.table.staged]
        taken = {a.slot for a in (*self.table.live.values(), *self.table.staged.values())}
        if len(new) > self.table.slots - len(taken):
            problems.append(f"adapters {new} need {len(new)} free slot(s); max_loras="
                            f"{self.table.slots} and {sorted(self.table.live)} hold "
                            f"{len(taken)}")
        for adapter, seen in ranks.items():
            if max(seen) > self.rank:
                problems.append(f"adapter {adapter!r} has rank {max(seen)} > max_lora_rank "
                                f"{self.rank}: start the engine with --max-lora-rank "
                                f"{max(seen)} or more")
            if len(seen) != 1:
                problems.append(f"adapter {adapter!r} mixes ranks {sorted(seen)}")
            if adapter not in alphas:
                problems.append(f"adapter {adapter!r} comes without lora/{adapter}/lora_alpha")
        if problems:
            raise MetadataError("update refused before any weight changed: "
                                + "; ".join(problems[:5]))
        self.inner.check(base)

    def _check_factor(self, meta: TensorMeta, module: str, ab: str,
                      ranks: dict[str, set[int]], adapter: str) -> list[str]:
        slot_a = self._modules.get(module)
        if slot_a is None:
            return [f"adapter {adapter!r} targets {module!r}, which has no LoRA slots here "
                    "(q/k/v/o/gate/up/down projections of each layer do)"]
        _, rank, inputs = slot_a.shape
        outputs = self.inner.held(module + ".lora_B")
        assert outputs is not None
        out_features = outputs.shape[1]
        r = meta.shape[0] if ab == "A" else meta.shape[-1]
        want = (r, inputs) if ab == "A" else (out_features, r)
        if len(meta.shape) != 2 or tuple(meta.shape) != want or r < 1:
            return [f"{meta.name!r}: shape {list(meta.shape)}, expected {list(want)} "
                    f"([rank, in] for lora_A, [out, rank] for lora_B)"]
        if r > rank:
            ranks.setdefault(adapter, set()).add(r)
            return []  # said once per adapter, by `check`
        if meta.dtype != slot_a.dtype:
            return [f"{meta.name!r}: dtype {meta.dtype}, the engine holds {slot_a.dtype}"]
        ranks.setdefault(adapter, set()).add(r)
        return []

    def companions(self, name: str) -> list[str]:
        """As `inner` (an FP8 weight's scales)."""
        return self.inner.companions(name)

    def held(self, name: str) -> TensorMeta | None:
        """As `inner` for base tensors (adapter tensors are checked by `check`)."""
        return self.inner.held(name)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Adapter tensors into their slot (cleared first, once per update); the rest to
        `inner`."""
        base: list[tuple[str, torch.Tensor]] = []
        for name, tensor in weights:
            parsed = _WIRE.fullmatch(name)
            if parsed is None:
                base.append((name, tensor))
                continue
            slot = self.table.slot_for(parsed["adapter"])
            self._clear(slot)
            if parsed["alpha"]:
                self._alpha[slot] = float(tensor.reshape(-1)[0])
            else:
                factor = "lora_" + parsed["ab"]
                rank = int(tensor.shape[0] if factor == "lora_A" else tensor.shape[-1])
                self._ranks[slot] = rank
                self._written.setdefault(slot, set()).add(parsed["module"])
                held = self.inner.held(f"{parsed['module']}.{factor}")
                assert held is not None
                region = self._slot_region(f"{parsed['module']}.{factor}", held, slot)
                if factor == "lora_A":
                    region[0, :rank].copy_(tensor)
                else:
                    region[0, :, :rank].copy_(tensor)
        if base:
            self._base_written = True
            self.inner.load_weights(base)

    def _slot_region(self, name: str, held: TensorMeta, slot: int) -> torch.Tensor:
        box = Box(offsets=(slot, *([0] * (len(held.shape) - 1))), lengths=(1, *held.shape[1:]))
        region = self.inner.region(name, box)
        if region is None:
            raise MetadataError(f"the engine's target offers no view of {name!r}")
        return region

    def _clear(self, slot: int) -> None:
        """Zero every module's slot once per update before an adapter is written into it
        (no module keeps a previous adapter's factors); before the update's first, `inner`
        is told the update patches its tensors."""
        if slot in self._cleared:
            return
        if not self._cleared:  # (a slot is a part of each factor's tensor: the rest stays)
            self.inner.patching()
        self._cleared.add(slot)
        for module in self._modules:
            for factor in ("lora_A", "lora_B", "lora_scale"):
                held = self.inner.held(f"{module}.{factor}")
                assert held is not None
                self._slot_region(f"{module}.{factor}", held, slot).zero_()

    def _set_scales(self, slot: int) -> None:
        """alpha / r on every module of the slot (`check` made sure both arrived)."""
        scale = self._alpha[slot] / self._ranks[slot]
        for module in self._modules:
            held = self.inner.held(f"{module}.lora_scale")
            assert held is not None
            self._slot_region(f"{module}.lora_scale", held, slot).fill_(scale)

    def keeps(self) -> dict[str, TensorLayout] | None:
        """As `inner`, and every adapter tensor the open update announced, whole (a worker
        keeps all of an adapter: its slot is written from the full factors)."""
        kept = self.inner.keeps()
        return None if kept is None else {**kept, **self._announced}

    def direct_bytes(self, name: str) -> torch.Tensor | None:
        """As `inner` for base tensors; None for adapter tensors (written into their slot)."""
        if name.startswith("lora/"):
            return None
        self._base_written = True  # the receiver writes it through this view
        return self.inner.direct_bytes(name)

    def region(self, name: str, box: Box) -> torch.Tensor | None:
        """As `inner` for base tensors."""
        if name.startswith("lora/"):
            return None
        self._base_written = True
        return self.inner.region(name, box)

    def snapshot(self, name: str, out: torch.Tensor | None = None) -> torch.Tensor | None:
        """As `inner` (staged updates need no snapshots: a shadow holds them)."""
        return None if name.startswith("lora/") else self.inner.snapshot(name, out)

    def restore(self, saved: Iterable[tuple[str, torch.Tensor]]) -> None:
        """As `inner` (only base tensors have snapshots)."""
        self.inner.restore(saved)

    def finish(self) -> None:
        """Every written slot's scales and record (rank, alpha, modules), then `inner`'s
        finish; the next update clears slots again."""
        for slot in self._alpha:
            self._set_scales(slot)
        for adapter in self.table.staged.values():
            if adapter.slot in self._alpha:
                adapter.rank, adapter.alpha = self._ranks[adapter.slot], self._alpha[adapter.slot]
                adapter.modules = tuple(sorted(self._written.get(adapter.slot, ())))
        self._cleared, self._announced = set(), {}
        self._alpha, self._ranks, self._written = {}, {}, {}
        self.inner.finish()

    def patching(self) -> None:
        """As `inner` (adapters always travel whole)."""
        self.inner.patching()

    def abort(self) -> None:
        """What the failed update staged is not served."""
        self._cleared, self._announced = set(), {}
        self._alpha, self._ranks, self._written = {}, {}, {}
        self._base_written = False
        self.table.drop()
        self.inner.abort()

    def fingerprint(self) -> dict[str, str]:
        """As `inner` (base weights and every slot)."""
        return self.inner.fingerprint()


def adapter_fingerprint(model: nn.Module, table: AdapterTable) -> dict[str, str]:
    """Digest of every live adapter as its trainer sent it, read back out of its slot:
    ``lora/<adapter>/<module>.lora_A.weight`` [r, in], ``...lora_B.weight`` [out, r] and
    ``lora/<adapter>/lora_alpha``, so that ``fingerprint(LoRASource(...).tensors())`` on the
    trainer equals these entries when the engine serves exactly that adapter."""
    modules = dict(model.named_modules())
    out: dict[str, str] = {}
    with torch.no_grad():
        for name, adapter in sorted(table.live.items()):
            for module_name in adapter.modules:
                module = modules[module_name]
                assert isinstance(module, LoRASlots)
                a = module.lora_A[adapter.slot, :adapter.rank].contiguous()
                b = module.lora_B[adapter.slot, :, :adapter.rank].contiguous()
                out[f"lora/{name}/{module_name}.lora_A.weight"] = tensor_digest(a)
                out[f"lora/{name}/{module_name}.lora_B.weight"] = tensor_digest(b)
            out[f"lora/{name}/lora_alpha"] = tensor_digest(
                torch.tensor([adapter.alpha], dtype=torch.float32))
    return out
