"""`ShardTarget`: what an engine worker's receiver writes into: the part of every checkpoint
tensor the worker keeps, in its live weights or in its staging shadow.

It accepts the full tensors (global names, shapes and dtypes: what a trainer sends), and keeps
its layout's part of each (`wtransfer.records.TensorLayout.take`); a tensor the worker holds
whole is written in place, straight from the receiver's buffers (`direct_bytes`). A worker of a
model that is not split holds every tensor whole, so the same target serves it (staged updates
of a single replica land in its shadow through it).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable

import torch
from torch import nn

from wtransfer.errors import MetadataError
from wtransfer.fingerprint import fingerprint
from wtransfer.inference.updates.staging import StagedWeights
from wtransfer.packing import TensorMeta, byte_view
from wtransfer.receiver.target import WeightTarget, copy_to_host
from wtransfer.records import Box, TensorLayout


class ShardTarget(WeightTarget):
    """The receiver's target of one worker (see the module docstring): into `module`'s
    tensors, or into `staging`'s shadow of them."""

    def __init__(self, module: nn.Module, layouts: dict[str, TensorLayout],
                 staging: StagedWeights | None = None) -> None:
        self.module = module
        self.layouts = layouts
        self.staging = staging
        self._live = dict(module.state_dict(keep_vars=True))
        missing = sorted(set(self._live) - set(layouts))
        if missing:
            raise MetadataError(f"no layout for {missing[:3]}")

    @property
    def stages(self) -> bool:
        """Whether writes land in the shadow until a commit makes them live."""
        return self.staging is not None

    def _live_part(self, name: str) -> torch.Tensor:
        """This worker's live part of `name` (`MetadataError` for a name it does not hold)."""
        part = self._live.get(name)
        if part is None:
            raise MetadataError(f"unknown tensor {name!r}")
        return part.data

    def _dest(self, name: str) -> torch.Tensor:
        live = self._live_part(name)
        return self.staging.dest(name) if self.staging is not None else live

    def metadata(self) -> list[TensorMeta]:
        """Every tensor as the trainer holds it: global names and shapes."""
        return [TensorMeta(n, lay.dtype, lay.shape) for n, lay in self.layouts.items()]

    def held(self, name: str) -> TensorMeta | None:
        """The global metadata of `name`, or None."""
        lay = self.layouts.get(name)
        return None if lay is None else TensorMeta(name, lay.dtype, lay.shape)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Keep this worker's part of each full tensor."""
        for name, tensor in weights:
            self._dest(name).copy_(self.layouts[name].take(tensor), non_blocking=True)

    def direct_bytes(self, name: str) -> torch.Tensor | None:
        """A byte view of a tensor this worker holds whole (None for a slice: the receiver
        assembles the full tensor, then `load_weights` takes the part)."""
        lay = self.layouts.get(name)
        if lay is None or not lay.is_whole:
            return None
        dest = self._dest(name)
        return byte_view(dest) if dest.is_contiguous() else None

    def keeps(self) -> dict[str, TensorLayout]:
        """This worker's layouts: an M->N transfer sends it only these parts."""
        return self.layouts

    def region(self, name: str, box: Box) -> torch.Tensor:
        """The view of global region `box` in this worker's part of `name` (live, or the
        shadow while staging)."""
        lay = self.layouts.get(name)
        if lay is None:
            raise MetadataError(f"unknown tensor {name!r}")
        return lay.view(self._dest(name), box)

    def regions_key(self) -> Hashable | None:
        """Where this worker's part of every tensor is written now (a `region` view stays
        valid while it does): the live parts, or while staging the shadow's (a swap commit
        alternates them between two sets, so views found for each set are kept)."""
        if self.staging is not None:
            shadow = self.staging.shadow_parts(self._live)
            return ("shadow", *((part.data_ptr(), part.stride()) for part in shadow))
        return tuple((part.data_ptr(), part.stride()) for part in
                     (self._live_part(name) for name in self._live))

    def alternate_regions_key(self) -> Hashable | None:
        """Under swap staging, the shadow's key after the next commit (the live parts now)."""
        if self.staging is None or self.staging.mode != "swap":
            return None
        return ("shadow", *((part.data_ptr(), part.stride()) for part in
                            (self._live_part(name) for name in self._live)))

    def written(self, names: Iterable[str]) -> None:
        """While staging, count `names` as written into the shadow (the commit makes them
        live)."""
        if self.staging is not None:
            self.staging.count_written(names)

    def patching(self) -> None:
        """While staging, level the shadow with the live weights (a delta writes onto them)."""
        if self.staging is not None:
            self.staging.level()

    def finish(self) -> None:
        """While staging, level what the update left unwritten (before a swap commit)."""
        if self.staging is not None:
            self.staging.level_unwritten()

    def snapshot(self, name: str, out: torch.Tensor | None = None) -> torch.Tensor | None:
        """A host copy of this worker's part of `name` as it holds it (into `out`, reused
        across updates, when it fits; pinned for a GPU worker): a worker never holds a full
        tensor's worth of host memory for a part; `restore` writes it back."""
        return copy_to_host(self._live_part(name), out)

    @torch.no_grad()
    def restore(self, saved: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Write back parts `snapshot` saved, each into the live tensor it came from."""
        for name, part in saved:
            self._live_part(name).copy_(part, non_blocking=True)

    def fingerprint(self) -> dict[str, str]:
        """Digest of this worker's live parts (by global name; not the full tensors')."""
        return fingerprint(self.module.state_dict())
