"""A wtransfer backend as a vLLM weight-transfer engine.

vLLM builds one engine per worker (`WeightTransferEngineFactory.create_engine`) and drives it
through init, start, update(s) and finish. Each call goes to a wtransfer receiver of the
backend over a `VLLMTarget`, so the receiver's guarantees hold inside vLLM: the manifest is
checked before any byte is written, every wait has the trainer's deadline, checksums are
verified, and a failed update puts the model back together (see `VLLMTarget.abort`). A call
that fails on some workers is raised by the last one only (`wtransfer_vllm.together`: vLLM's
executor would otherwise answer later calls with stale replies).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, ClassVar

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine

from wtransfer.errors import (
    ConfigError,
    LifecycleError,
    TransferTimeout,
    WTransferError,
    error_kind,
)
from wtransfer.receiver.engine import ReceiverState
from wtransfer.receiver.engine import WeightTransferEngine as Receiver
from wtransfer.registry import create_receiver
from wtransfer_vllm.envelope import unwrap
from wtransfer_vllm.shadow import CommitMode, Shadow
from wtransfer_vllm.staging import ShadowStaging
from wtransfer_vllm.target import VLLMTarget
from wtransfer_vllm.together import install

log = logging.getLogger("wtransfer.vllm")


def worker_index(parallel_config: Any) -> int:
    """This worker's index among every receiving worker: data-parallel replicas one after
    another, each with its tensor x pipeline parallel workers."""
    local = 0
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        local = torch.distributed.get_rank() % parallel_config.world_size
    replica = getattr(parallel_config, "data_parallel_index", 0) or 0
    return int(replica * parallel_config.world_size + local)


@contextlib.contextmanager
def relaying() -> Iterator[None]:
    """vLLM passes a worker's failure on to the trainer as its text only: a wtransfer error
    leaves the worker with its kind in front (``"SenderReplacedError: ..."``), so the clients
    raise the same kind (`wtransfer.errors.relayed_kind`)."""
    try:
        yield
    except WTransferError as exc:
        if str(exc).startswith(f"{error_kind(exc)}: "):
            raise
        raise type(exc)(f"{error_kind(exc)}: {exc}") from exc


class WTransferEngine(WeightTransferEngine[Any, Any]):
    """Base of the per-backend engines; `wtransfer_backend` names the wtransfer backend."""

    wtransfer_backend: ClassVar[str] = ""
    staged: ClassVar[bool] = False
    """Whether updates land in a shadow of the model's layers while vLLM generates and go
    live at finish, between two steps (`wtransfer_vllm.staging`): the
    ``wtransfer-<name>-staged`` engines."""
    init_info_cls = dict
    update_info_cls = dict
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device,
                 model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self._end_update = install()  # a call failing on some workers fails once, on the
        # last; `_end_update` ends a failed update on this worker as vLLM's worker would
        self.target = VLLMTarget(model, vllm_config.model_config)
        self.staging: ShadowStaging | None = None
        """The shadow staged updates land in (None: updates load into the live model)."""
        into: VLLMTarget | ShadowStaging = self.target
        if self.staged:
            mode = shadow_mode(vllm_config)
            shadow = Shadow(model, mode)
            self.staging = into = ShadowStaging(self.target, shadow, vllm_config.model_config)
            log.info("wtransfer-vllm: staged updates load into a shadow of %d layers "
                     "(%.1f MB of parameters and buffers here, plus what processing packs) "
                     "and go live by %s between two steps", len(shadow.pairs),
                     shadow.nbytes / 1e6, mode)
        self.receiver: Receiver[Any, Any] = create_receiver(
            self.wtransfer_backend, into, device=str(device),
            worker_index=worker_index(vllm_config.parallel_config))
        self._receiving = ThreadPoolExecutor(1, thread_name_prefix="wtransfer-vllm-receive")
        self._received: list[Future[None]] = []
        """Update calls received on `_receiving` (a staged engine whose backend's data plane
        paces the sender), settled at finish."""

    def parse_init_info(self, init_dict: dict[str, Any]) -> Any:
        """Our receiver parses the record itself (strictly, naming the bad field)."""
        return unwrap(init_dict)

    def parse_update_info(self, update_dict: dict[str, Any]) -> Any:
        """As `parse_init_info`."""
        return unwrap(update_dict)

    def init_transfer_engine(self, init_info: Any) -> None:
        """Join the trainer's transfer (open staging, form groups)."""
        self._received = []  # (a new sender: what the old one left is moot)
        with relaying():
            self.receiver.init_transfer_engine(init_info)

    def start_weight_update(self) -> None:
        """Open an update; vLLM's layerwise reload starts with the first accepted tensors.
        Update calls of an earlier update still received in the background (one that failed
        without a finish) are its own: they are not this update's."""
        self._received = []
        with relaying():
            self.receiver.start_weight_update()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Receive one part of the update. Our receivers finish their own device work before
        returning, so no accelerator-wide synchronize (which CPU builds of torch refuse)."""
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: Any) -> None:
        """Hand the update to the receiver: on a thread of ours, answering at once, for a
        staged engine whose backend's data plane paces the sender (nccl, ucx: their one
        update call carries the whole transfer, which would hold vLLM's engine core)."""
        if self.staging is not None and not self.receiver.capabilities.calls_read_sender_memory:
            self._received.append(self._receiving.submit(self._receive_in_background,
                                                         update_info))
            return
        self._receive(update_info)

    def _receive(self, update_info: Any) -> None:
        with relaying():
            self.receiver.update_weights(update_info)

    def _receive_in_background(self, update_info: Any) -> None:
        """`_receive` on our thread: a failure there answers no call of vLLM's, so the
        update is ended here as vLLM's worker ends one whose call raised (the next start
        is then taken); the finish, if it comes, raises it."""
        try:
            self._receive(update_info)
        except BaseException:
            if self._end_update is not None:
                self._end_update()
            raise

    def _settle_received(self) -> None:
        """Wait for the update calls received in the background (within the transfer's
        deadline); raise the first one's failure."""
        info = self.receiver.init_info
        deadline = time.monotonic() + (info.timeout_s if info is not None else 600.0)
        received, self._received = self._received, []
        for call in received:
            try:
                call.result(timeout=max(deadline - time.monotonic(), 0.0))
            except TimeoutError:
                with relaying():
                    self.receiver.fail_update("the transfer did not end within its deadline")
                    raise TransferTimeout("wtransfer-vllm: the update's transfer did not end "
                                          "within its deadline") from None

    def finish_weight_update(self) -> None:
        """Check every tensor arrived, then make the update live: a staged engine commits
        its shadow (the layers the update loaded) between two steps; otherwise vLLM
        finishes processing the layers it reloaded."""
        self._settle_received()
        if self.staging is not None and self.receiver.init_info is not None:
            self.staging.timeout_s = self.receiver.init_info.timeout_s
        with relaying():
            self.receiver.finish_weight_update()

    def shutdown(self) -> None:
        """Release staging buffers, groups and the shadow's threads."""
        self._receiving.shutdown(wait=False, cancel_futures=True)
        self.receiver.shutdown()
        if self.staging is not None:
            self.staging.close()

    def state(self) -> dict[str, Any]:
        """The receiver's state, why the last update failed, if it did, and the bytes of the
        checkpoint this worker keeps (once an M->N transfer recorded them)."""
        receiver = self.receiver
        staging = self.staging
        return {"backend": self.wtransfer_backend, "state": receiver.state.value,
                "torn": receiver.torn, "failure": receiver.failure,
                "last_update_bytes": receiver.last_update_bytes,
                "kept_bytes": self.target.kept_bytes(),
                "staging": staging.shadow.mode if staging is not None else "off",
                "loading": bool(staging is not None and (staging.loading or any(
                    not call.done() for call in self._received))),
                "commit_ms": staging.commit_ms if staging is not None else None,
                "finish_ms": staging.finish_ms if staging is not None else None}

    def rollback(self) -> int:
        """Make the version before the last staged commit live again (a swap back: its
        layers' twins still hold it); returns how many layers changed."""
        with relaying():
            if self.staging is None:
                raise LifecycleError("wtransfer-vllm: rollback needs a staged engine "
                                     "(engine_kwargs(backend, staged=True))")
            if self.receiver.state is ReceiverState.UPDATING:
                raise LifecycleError("wtransfer-vllm: an update is open; finish it first")
            return self.staging.rollback()


def shadow_mode(vllm_config: Any) -> CommitMode:
    """How a staged engine commits: by copying into the live storages where captured CUDA
    graphs read them (they keep their addresses), else by swapping (eager); the environment
    variable ``WTRANSFER_VLLM_COMMIT`` ("swap" or "copy") chooses by name."""
    named = os.environ.get("WTRANSFER_VLLM_COMMIT")
    if named is not None:
        if named not in ("swap", "copy"):
            raise ConfigError(f"WTRANSFER_VLLM_COMMIT must be 'swap' or 'copy', got "
                              f"{named!r}")
        return named  # type: ignore[return-value]
    graphs = not vllm_config.model_config.enforce_eager and torch.cuda.is_available()
    return "copy" if graphs else "swap"


def engine_class(backend: str, *, staged: bool = False) -> type[WTransferEngine]:
    """The vLLM engine class serving wtransfer backend `backend` (with a shadow)."""
    name = "WTransfer" + "".join(p.capitalize() for p in backend.replace("-", "_").split("_"))
    how = ", loaded into a shadow while vLLM generates, live at finish" if staged else ""
    return type(f"{name}{'Staged' if staged else ''}Engine", (WTransferEngine,), {
        "wtransfer_backend": backend, "staged": staged, "__module__": __name__,
        "__doc__": f"wtransfer backend {backend!r} as a vLLM weight-transfer engine{how}."})
