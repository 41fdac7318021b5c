"""Host staging for vLLM: an update lands in buffers of its own while vLLM keeps generating,
and goes into the model only at finish.

vLLM's own pause is still needed around its weight loading (layerwise reload rewrites the
model's kernels), but not around the transfer: with the ``wtransfer-<name>-staged`` engines
the update calls only fill `HostStaging` buffers (host memory, kept across updates), and
`finish_weight_update` hands them to the model's loader. A trainer pauses only around the
finish with ``send_weights(..., pause="keep")``.

vLLM runs each update call between two of its steps, so generation goes on between the calls:
with ipc (one call per bucket) the engine steps between buckets; a backend whose one update
call carries the whole transfer (nccl, ucx) still holds vLLM's engine core for it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from wtransfer.packing import DTYPES, TensorMeta, byte_view
from wtransfer.receiver.target import WeightTarget
from wtransfer.records import Box, TensorLayout
from wtransfer_vllm.target import VLLMTarget


class HostStaging(WeightTarget):
    """Every write lands in a host buffer per tensor (allocated once, pinned where CUDA is);
    `finish` loads them into the vLLM model (`VLLMTarget`), in arrival order."""

    @property
    def takes_deltas(self) -> bool:
        """False, as the vLLM model it loads into at finish (`VLLMTarget.takes_deltas`)."""
        return False

    @property
    def stages(self) -> bool:
        """Writes land in host buffers until `finish` loads them into the model."""
        return True

    def __init__(self, model_target: VLLMTarget) -> None:
        self.model_target = model_target
        self._buffers: dict[str, torch.Tensor] = {}
        self._announced: dict[str, TensorMeta] = {}
        self._staged: dict[str, None] = {}
        """Names written by the open update, in order (what `finish` loads)."""

    def metadata(self) -> list[TensorMeta]:
        """The checkpoint's tensors."""
        return self.model_target.metadata()

    def held(self, name: str) -> TensorMeta | None:
        """The checkpoint's entry for `name`."""
        return self.model_target.held(name)

    def check(self, metas: Sequence[TensorMeta]) -> None:
        """The model's own check (names, shapes, castable dtypes), before any byte lands."""
        self.model_target.check(metas)
        self._announced.update({m.name: m for m in metas})

    def _buffer(self, name: str) -> torch.Tensor:
        meta = self._announced[name]
        held = self._buffers.get(name)
        if held is None or held.shape != meta.shape or held.dtype != DTYPES[meta.dtype]:
            held = self._buffers[name] = torch.empty(
                meta.shape, dtype=DTYPES[meta.dtype], pin_memory=torch.cuda.is_available())
        self._staged[name] = None
        return held

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy each tensor into its host buffer."""
        for name, tensor in weights:
            self._buffer(name).copy_(tensor)

    def direct_bytes(self, name: str) -> torch.Tensor | None:
        """The host buffer's bytes (a receiver writes straight into it)."""
        return byte_view(self._buffer(name))

    def keeps(self) -> dict[str, TensorLayout]:
        """What the model's loaders read (`VLLMTarget.keeps`): an M->N update stages only
        that, in place in the full-shaped host buffers."""
        return self.model_target.keeps()

    def region(self, name: str, box: Box) -> torch.Tensor:
        """The view of global region `box` of `name`'s host buffer."""
        return self._buffer(name)[box.slices()]

    def finish(self) -> None:
        """Load what the update staged into the model, then let vLLM finish its layers."""
        staged, self._staged = list(self._staged), {}
        if staged and self._buffers[staged[0]].is_pinned():
            torch.cuda.synchronize()  # the receiver's copies into pinned memory
        self.model_target.load_weights((name, self._buffers[name]) for name in staged)
        self.model_target.finish()

    def abort(self) -> None:
        """Drop the staged names (the model was not touched unless finish had begun, and then
        the model target puts it back together)."""
        self._staged = {}
        self.model_target.abort()

    def fingerprint(self) -> dict[str, str]:
        """What the model holds (staged bytes count once they were loaded)."""
        return self.model_target.fingerprint()
