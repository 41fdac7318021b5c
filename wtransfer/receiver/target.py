"""Engine-side receiver adapters: where received weights land."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence

import torch
from torch import nn

from wtransfer.errors import MetadataError
from wtransfer.fingerprint import fingerprint
from wtransfer.packing import DTYPES, TensorMeta, byte_view, signature
from wtransfer.records import Box, TensorLayout


def copy_to_host(tensor: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """`tensor` copied into host tensor `out` (or a new one, pinned for CUDA sources, when
    `out` does not fit); a CUDA copy is ordered on the current stream, before any later write
    to `tensor` on that stream."""
    if out is None or out.shape != tensor.shape or out.dtype != tensor.dtype:
        out = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu",
                          pin_memory=tensor.is_cuda)
    out.copy_(tensor, non_blocking=tensor.is_cuda)
    return out


class WeightTarget(ABC):
    """What an engine hands to a `WeightTransferEngine`: what it accepts and how to load it.
    Tensors passed to `load_weights` are views of staging memory, valid only during the call: a
    target must copy them into its own storage before returning."""

    @property
    def stages(self) -> bool:
        """True for a target whose writes land in a copy of its own until `finish` makes them
        live (a shadow, host staging): an update that fails before its finish leaves the live
        weights whole, so it is never torn and needs no rollback copies."""
        return False

    @property
    def takes_deltas(self) -> bool:
        """Whether a delta (an update of only the changed tensors, or elements) can land here;
        False for a target that must get whole modules (vLLM reloads a fused layer from what
        one update sent): a delta-enabled sender then sends full updates."""
        return True

    def companions(self, name: str) -> list[str]:
        """Tensors a write of `name` also changes (an FP8 weight's scales): kept for rollback
        with it, and checked with it."""
        return []

    @abstractmethod
    def metadata(self) -> list[TensorMeta]:
        """Every tensor this target accepts, under the names a sender must use."""

    @abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy each ``(name, tensor)`` into place; called only with already-checked tensors."""

    def held(self, name: str) -> TensorMeta | None:
        """Metadata of what this target holds under an incoming `name`, or None if unknown."""
        for meta in self.metadata():
            if meta.name == name:
                return meta
        return None

    def check(self, metas: Sequence[TensorMeta]) -> None:
        """Refuse an update (before any byte is written) whose tensors this target cannot take."""
        problems = []
        # the default `held` scans metadata(): index it once instead of once per tensor
        index = ({m.name: m for m in self.metadata()}
                 if type(self).held is WeightTarget.held else None)
        for meta in metas:
            have = index.get(meta.name) if index is not None else self.held(meta.name)
            if have is None:
                problems.append(f"unknown tensor {meta.name!r}")
            elif (have.dtype, have.shape) != (meta.dtype, meta.shape):
                problems.append(f"{meta.name!r}: sent {meta.dtype}{list(meta.shape)}, "
                                f"engine holds {have.dtype}{list(have.shape)}")
        if problems:
            more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
            raise MetadataError("update refused before any weight changed: "
                                + "; ".join(problems[:5]) + more)

    def direct_bytes(self, name: str) -> torch.Tensor | None:
        """A writable flat uint8 view of the storage behind `name`, or None. When given, a receiver
        writes the tensor's bytes straight into it instead of calling `load_weights`."""
        return None

    def keeps(self) -> dict[str, TensorLayout] | None:
        """What this worker keeps of each tensor, by incoming name (an M->N transfer sends it
        exactly that), or None: every tensor whole."""
        return None

    def region(self, name: str, box: Box) -> torch.Tensor | None:
        """A writable view of global region `box` of tensor `name` (which must lie in what
        this target `keeps`), or None: an M->N receiver then assembles the whole tensor and
        hands it to `load_weights`."""
        return None

    def written(self, names: Iterable[str]) -> None:
        """The receiver wrote `names` through views an earlier update found (a replayed
        program: no `region` or `direct_bytes` call this time); a target that counts what an
        update wrote (a staging shadow) counts them. The default does nothing."""
        return None

    def alternate_regions_key(self) -> Hashable | None:
        """`regions_key` as it will be after the next commit, for a target whose commits
        alternate two sets of storages (a swap-staged shadow), so a receiver keeps the views
        of both; None, the default, for any other target."""
        return None

    def regions_key(self) -> Hashable | None:
        """What identifies the storages `region` and `direct_bytes` view now, and what
        `keeps` answers (equal keys: equal views and parts), so a receiver may reuse an
        earlier update's views (`wtransfer.receiver.programs`); None, the default, for a
        target that cannot tell: its views are found anew every time."""
        return None

    def snapshot(self, name: str, out: torch.Tensor | None = None) -> torch.Tensor | None:
        """Copy what the target holds under `name` now into host memory, for rolling a failed
        update back (it is given back through `restore`): into `out` when it has the
        right shape and dtype (reused across updates), else into a new tensor, which is
        returned. None when the target cannot say what it holds."""
        direct = self.direct_bytes(name)
        meta = self.held(name)
        if direct is None or meta is None:
            return None
        return copy_to_host(direct.view(DTYPES[meta.dtype]).reshape(meta.shape), out)

    def restore(self, saved: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Put back what `snapshot` saved (a failed update's rollback): by default through
        `load_weights`; a target whose snapshots are not full tensors (a worker's own part)
        writes them back itself."""
        self.load_weights(saved)

    def patching(self) -> None:  # noqa: B027 - optional hook
        """An update that writes only some elements of its tensors (a delta) begins: every
        view `region` and `direct_bytes` give from here on must hold the weights as they are
        (a staging target levels its shadow). The default does nothing."""

    def finish(self) -> None:  # noqa: B027 - optional hook
        """Post-process after all tensors of an update landed (e.g. re-quantize)."""

    def abort(self) -> None:  # noqa: B027 - optional hook
        """An update failed: drop whatever partial-load state the target keeps (an engine
        that buffers tensors until a whole layer arrived, say). Called before any rollback."""

    @abstractmethod
    def fingerprint(self) -> dict[str, str]:
        """Per-tensor digest of what the target holds now (see `wtransfer.fingerprint`)."""


class ModuleTarget(WeightTarget):
    """Loads into an `nn.Module`'s existing parameters and buffers in place; storage pointers never
    change (CUDA graphs over the module stay valid). `name_map` (a mapping or a function) renames
    incoming names to the module's; `post_process(module)` runs at the end of every update."""

    def __init__(
        self,
        module: nn.Module,
        name_map: Mapping[str, str] | Callable[[str], str] | None = None,
        post_process: Callable[[nn.Module], None] | None = None,
    ) -> None:
        self.module = module
        self._state = module.state_dict(keep_vars=True)
        self._map: Callable[[str], str] = (
            (lambda n: name_map.get(n, n)) if isinstance(name_map, Mapping)
            else name_map if name_map is not None else (lambda n: n)
        )  # fmt: skip
        self._post_process = post_process
        self._views: dict[str, torch.Tensor] = {}
        self._checked: tuple[Sequence[TensorMeta], list[torch.Tensor],
                             tuple[list[torch.Size], list[torch.dtype]]] | None = None
        """The last list that passed `check`, its destinations and their `signature` then: the
        same list object (receivers keep the one they parsed while the sender's list is
        unchanged) passes again while the destinations still have them."""

    def _dest(self, name: str) -> torch.Tensor:
        try:
            return self._state[self._map(name)].data
        except KeyError:
            raise MetadataError(f"unknown tensor {name!r}") from None

    def metadata(self) -> list[TensorMeta]:
        """The module's state-dict entries (aliases of tied weights included)."""
        return [TensorMeta.of(n, t) for n, t in self._state.items()]

    def held(self, name: str) -> TensorMeta | None:
        """Metadata of the parameter or buffer `name` maps to, or None."""
        dest = self._state.get(self._map(name))
        return None if dest is None else TensorMeta.of(name, dest)

    def check(self, metas: Sequence[TensorMeta]) -> None:
        """Refuse an update whose tensors the module does not hold as sent (compared against
        the live parameters, without building their metadata: an update checks hundreds)."""
        if self._checked is not None and self._checked[0] is metas:
            _, held, then = self._checked  # the same list again: every step
            if signature(held) == then:
                return
        self._checked = None
        held = []
        for meta in metas:
            dest = self._state.get(self._map(meta.name))
            if dest is None or dest.shape != meta.shape or dest.dtype != DTYPES.get(meta.dtype):
                super().check(metas)  # names every problem
                return
            held.append(dest)
        self._checked = (metas, held, signature(held))

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy each tensor into the existing storage of its parameter or buffer."""
        for name, tensor in weights:
            self._dest(name).copy_(tensor, non_blocking=True)

    def direct_bytes(self, name: str) -> torch.Tensor | None:
        """Byte view of a contiguous destination; None when it is not contiguous."""
        cached = self._views.get(name)
        if cached is not None:  # still the parameter's storage (checked without `.data`)
            held = self._state.get(self._map(name))
            if held is not None and held.data_ptr() == cached.data_ptr() and \
                    held.nbytes == cached.numel():
                return cached
        dest = self._dest(name)
        view = byte_view(dest) if dest.is_contiguous() else None
        if view is not None:
            self._views[name] = view
        return view

    def region(self, name: str, box: Box) -> torch.Tensor:
        """The part `box` of the parameter or buffer `name` maps to (a view)."""
        return self._dest(name)[box.slices()]

    def regions_key(self) -> Hashable | None:
        """Where every parameter and buffer lives now (a `region` or `direct_bytes` view stays
        valid while it does); None for a subclass that finds its destinations its own way."""
        kind = type(self)
        if kind.region is not ModuleTarget.region or kind._dest is not ModuleTarget._dest \
                or kind.direct_bytes is not ModuleTarget.direct_bytes \
                or kind.keeps is not ModuleTarget.keeps:
            return None
        return tuple((tensor.data_ptr(), tensor.stride()) for tensor in self._state.values())

    def snapshot(self, name: str, out: torch.Tensor | None = None) -> torch.Tensor | None:
        """Copy the parameter or buffer `name` maps to into host memory (`out` if it fits)."""
        return copy_to_host(self._dest(name).detach(), out)

    def finish(self) -> None:
        """Run `post_process(module)`, if given."""
        if self._post_process is not None:
            self._post_process(self.module)

    def fingerprint(self) -> dict[str, str]:
        """Digest of every state-dict entry of the module."""
        return fingerprint(self.module.state_dict())
