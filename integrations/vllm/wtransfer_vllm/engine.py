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
from collections.abc import Iterator
from typing import Any, ClassVar

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine

from wtransfer.errors import WTransferError, error_kind
from wtransfer.receiver.engine import WeightTransferEngine as Receiver
from wtransfer.registry import create_receiver
from wtransfer_vllm.envelope import unwrap
from wtransfer_vllm.staging import HostStaging
from wtransfer_vllm.target import VLLMTarget
from wtransfer_vllm.together import install


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
    """Whether updates land in host staging and reach the model only at finish
    (`wtransfer_vllm.staging`): the ``wtransfer-<name>-staged`` engines."""
    init_info_cls = dict
    update_info_cls = dict
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device,
                 model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        install()  # a call failing on some workers fails once, on the last
        self.target = VLLMTarget(model, vllm_config.model_config)
        into: VLLMTarget | HostStaging = HostStaging(self.target) if self.staged else self.target
        self.receiver: Receiver[Any, Any] = create_receiver(
            self.wtransfer_backend, into, device=str(device),
            worker_index=worker_index(vllm_config.parallel_config))

    def parse_init_info(self, init_dict: dict[str, Any]) -> Any:
        """Our receiver parses the record itself (strictly, naming the bad field)."""
        return unwrap(init_dict)

    def parse_update_info(self, update_dict: dict[str, Any]) -> Any:
        """As `parse_init_info`."""
        return unwrap(update_dict)

    def init_transfer_engine(self, init_info: Any) -> None:
        """Join the trainer's transfer (open staging, form groups)."""
        with relaying():
            self.receiver.init_transfer_engine(init_info)

    def start_weight_update(self) -> None:
        """Open an update; vLLM's layerwise reload starts with the first accepted tensors."""
        with relaying():
            self.receiver.start_weight_update()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Receive one part of the update. Our receivers finish their own device work before
        returning, so no accelerator-wide synchronize (which CPU builds of torch refuse)."""
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: Any) -> None:
        """Hand the update to the receiver."""
        with relaying():
            self.receiver.update_weights(update_info)

    def finish_weight_update(self) -> None:
        """Check every tensor arrived, then let vLLM finish processing the layers."""
        with relaying():
            self.receiver.finish_weight_update()

    def shutdown(self) -> None:
        """Release staging buffers and groups."""
        self.receiver.shutdown()

    def state(self) -> dict[str, Any]:
        """The receiver's state, why the last update failed, if it did, and the bytes of the
        checkpoint this worker keeps (once an M->N transfer recorded them)."""
        receiver = self.receiver
        return {"backend": self.wtransfer_backend, "state": receiver.state.value,
                "torn": receiver.torn, "failure": receiver.failure,
                "last_update_bytes": receiver.last_update_bytes,
                "kept_bytes": self.target.kept_bytes()}


def engine_class(backend: str, *, staged: bool = False) -> type[WTransferEngine]:
    """The vLLM engine class serving wtransfer backend `backend` (with host staging)."""
    name = "WTransfer" + "".join(p.capitalize() for p in backend.replace("-", "_").split("_"))
    how = ", staged in host memory until finish" if staged else ""
    return type(f"{name}{'Staged' if staged else ''}Engine", (WTransferEngine,), {
        "wtransfer_backend": backend, "staged": staged, "__module__": __name__,
        "__doc__": f"wtransfer backend {backend!r} as a vLLM weight-transfer engine{how}."})
