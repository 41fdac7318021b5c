"""`ShadowStaging`: a staged update inside vLLM lands in the worker's `Shadow`, loaded by vLLM's
own loaders on a thread of ours while vLLM keeps generating; its finish makes it live between
two steps.

Each complete tensor the receiver hands over is copied into a host buffer of its own (kept
across updates) and queued for the loader thread, which feeds the shadow's copy of the model
through ``load_weights``; a layer is processed (fused, repacked) as soon as its tensors are
in. `finish` waits for the queue (within the transfer's deadline), processes what is left,
and commits: the layers the update loaded become live at once (`Shadow.commit`). A failed
update drops the shadow's partial loads; the live model never saw them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from wtransfer.errors import TransferTimeout
from wtransfer.packing import DTYPES, TensorMeta
from wtransfer.receiver.target import WeightTarget
from wtransfer.records import TensorLayout
from wtransfer_vllm.shadow import Shadow
from wtransfer_vllm.target import VLLMTarget

log = logging.getLogger("wtransfer.vllm")

LOAD_TIMEOUT_S = 600.0
"""How long `finish` waits for the loader thread where no transfer deadline is known."""


class ShadowStaging(WeightTarget):
    """Writes land in host buffers and, tensor by tensor, in the shadow (see the module
    docstring); `finish` commits, `abort` discards."""

    def __init__(self, model_target: VLLMTarget, shadow: Shadow, model_config: Any,
                 timeout_s: float = LOAD_TIMEOUT_S) -> None:
        self.model_target = model_target
        self.shadow = shadow
        self.model_config = model_config
        self.timeout_s = timeout_s
        """How long `finish` waits for the loads still queued (the engine sets the
        transfer's deadline)."""
        self._buffers: dict[str, torch.Tensor] = {}
        self._announced: dict[str, TensorMeta] = {}
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="wtransfer-vllm-load")
        self._queue: list[tuple[str, torch.Tensor]] = []
        self._queue_lock = threading.Lock()
        self._loads: list[Future[None]] = []
        self.commit_ms = 0.0
        """How long the last commit held the worker (the exchange itself)."""
        self.finish_ms = 0.0
        """How long the last finish held the worker: the loads still queued, what was left
        to process, and the commit."""

    @property
    def takes_deltas(self) -> bool:
        """False, as the vLLM model (`VLLMTarget.takes_deltas`)."""
        return False

    @property
    def stages(self) -> bool:
        """Writes land in the shadow until `finish` makes them live."""
        return True

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

    def keeps(self) -> dict[str, TensorLayout]:
        """What this worker's loaders read (`VLLMTarget.keeps`): an M->N update sends it only
        that (assembled in a full-shaped tensor the loader reads its part of)."""
        return self.model_target.keeps()

    def _buffer(self, name: str) -> torch.Tensor:
        meta = self._announced[name]
        held = self._buffers.get(name)
        if held is None or held.shape != meta.shape or held.dtype != DTYPES[meta.dtype]:
            held = self._buffers[name] = torch.empty(
                meta.shape, dtype=DTYPES[meta.dtype], pin_memory=torch.cuda.is_available())
        return held

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy each complete tensor into its host buffer and queue it for the loader (which
        also digests it: a digest of a large tensor would hold vLLM's step loop)."""
        queued = []
        for name, tensor in weights:
            buffer = self._buffer(name)
            buffer.copy_(tensor)
            queued.append((name, buffer))
        if queued:
            if torch.cuda.is_available() and any(t.is_pinned() for _, t in queued):
                torch.cuda.synchronize()  # the copies into pinned memory are done
            with self._queue_lock:
                self._queue += queued
            self._loads.append(self._loader.submit(self._load_queued))

    def _load_queued(self) -> None:
        """On the loader thread: note everything queued so far (digests; adapters are kept
        in memory, no shadow needed) and feed the checkpoint tensors to the shadow, in one
        call."""
        with self._queue_lock:
            batch, self._queue = self._queue, []
        checkpoint = [(name, tensor) for name, tensor in batch
                      if self.model_target.note(name, tensor)]
        if checkpoint:
            self.shadow.load(checkpoint)

    def _wait_loads(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        loads, self._loads = self._loads, []
        for load in loads:
            left = deadline - time.monotonic()
            try:
                load.result(timeout=max(left, 0.0))
            except TimeoutError:
                raise TransferTimeout(f"wtransfer-vllm: loading the update into the shadow "
                                      f"took more than {self.timeout_s:g}s") from None

    @property
    def loading(self) -> bool:
        """Whether loads into the shadow are still queued or running."""
        return any(not load.done() for load in self._loads)

    def finish(self) -> None:
        """Wait for the loader, process what is left, then make the update live."""
        entered = time.perf_counter()
        self._wait_loads()
        self.shadow.close(self.model_config)
        started = time.perf_counter()
        layers = self.shadow.commit()
        self.commit_ms = (time.perf_counter() - started) * 1e3
        self.finish_ms = (time.perf_counter() - entered) * 1e3
        log.debug("wtransfer-vllm: %d layer(s) live in %.2f ms (%s)", layers, self.commit_ms,
                  self.shadow.mode)
        self.model_target.landed()
        self._announced = {}

    def abort(self) -> None:
        """Drop what the failed update queued and loaded (the live model is untouched)."""
        try:
            self._wait_loads()
        except Exception:  # a load that failed or hangs: the shadow is discarded anyway
            log.warning("wtransfer-vllm: a shadow load of the failed update did not end "
                        "cleanly", exc_info=True)
        with self._queue_lock:
            self._queue = []
        self.shadow.discard()
        self.model_target.dropped()
        self._announced = {}

    def rollback(self) -> int:
        """Make the version before the last commit live again (`Shadow.swap_back`); returns
        how many layers changed."""
        layers = self.shadow.swap_back()
        self.model_target.restored()
        return layers

    def fingerprint(self) -> dict[str, str]:
        """What the live model holds (a staged update counts once it committed)."""
        return self.model_target.fingerprint()

    def close(self) -> None:
        """Stop the loader thread."""
        self._loader.shutdown(wait=False, cancel_futures=True)
