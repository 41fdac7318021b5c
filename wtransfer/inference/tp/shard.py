"""`ShardWeights`: one engine worker's weights and the receiver that updates them.

A replica's rank 0 and each of its tensor-parallel workers hold one: the worker's part of the
model (the whole model when it is not split), the shadow a staged update lands in, the target
that keeps the worker's part of every full tensor (`ShardTarget`), and the backend's receiver.
The weight-transfer calls of the engine run here on every rank alike; a staged update's commit
(`commit`) and a rollback run on each rank at the same step boundary.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from wtransfer.errors import LifecycleError, NotInitializedError
from wtransfer.inference.updates.lora import AdapterTable, LoRATarget
from wtransfer.inference.updates.release import release_module
from wtransfer.inference.updates.shard_target import ShardTarget
from wtransfer.inference.updates.staging import StagedWeights, StagingMode
from wtransfer.quant.target import Fp8Target
from wtransfer.receiver.engine import ReceiverState, WeightTransferEngine
from wtransfer.receiver.target import WeightTarget
from wtransfer.records import TensorLayout, check_version
from wtransfer.registry import create_receiver


class ShardWeights:
    """One worker's weights (see the module docstring)."""

    def __init__(self, model: nn.Module, layouts: dict[str, TensorLayout], *, backend: str,
                 device: str, worker_index: int, staging: StagingMode,
                 rollback: bool, checkpoint_dtype: str | None = None,
                 adapters: AdapterTable | None = None, lora_rank: int = 0) -> None:
        self.model = model
        self.layouts = layouts
        self.backend = backend
        self.device = device
        self.worker_index = worker_index
        """This worker's index among the engine's receiving workers."""
        self.staging = StagedWeights(model, staging) if staging != "off" else None
        self.rollback = rollback and self.staging is None
        self.target: WeightTarget = ShardTarget(model, layouts, self.staging)
        """What the receiver writes (the shadow when staging; through `Fp8Target` for an FP8
        model, `checkpoint_dtype` given: what its trainer holds)."""
        if checkpoint_dtype is not None:
            self.target = Fp8Target(self.target, checkpoint_dtype)
        if adapters is not None:
            self.target = LoRATarget(self.target, adapters, lora_rank)
        self.live = ShardTarget(model, layouts)
        """The live weights (what a fingerprint reads)."""
        self.receiver: WeightTransferEngine[Any, Any] | None = None
        held = {t.data_ptr(): t for t in model.state_dict().values()}  # tied weights once
        self.kept_bytes = sum(t.numel() * t.element_size() for t in held.values())
        """Bytes of this worker's part of the model (what an M->N update sends it)."""

    @property
    def update_open(self) -> bool:
        """Whether an update is open on this worker."""
        return self.receiver is not None and self.receiver.state is ReceiverState.UPDATING

    def _receiver(self) -> WeightTransferEngine[Any, Any]:
        if self.receiver is None:
            raise NotInitializedError("no sender initialized this engine: call "
                                      "init_weight_transfer_engine first")
        return self.receiver

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """Create (once) the backend's receiver over this worker's target and initialize it."""
        if self.receiver is None:
            self.receiver = create_receiver(self.backend, self.target, device=self.device,
                                            worker_index=self.worker_index,
                                            rollback=self.rollback)
        self.receiver.init_transfer_engine(init_info)

    def start_weight_update(self) -> None:
        """Open an update; a staging worker opens its shadow to it first."""
        receiver = self._receiver()
        if self.staging is not None:
            if self.update_open:  # the shadow it stages into must not be reopened under it
                raise LifecycleError("an update is open; finish it first")
            self.staging.prepare()
        receiver.start_weight_update()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Receive one part of the update."""
        self._receiver().update_weights(update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """Close the update: in place, the weights are live; staged, every tensor arrived in
        the shadow and `commit` makes them live."""
        if weight_version is not None:
            check_version(weight_version)
        self._receiver().finish_weight_update(weight_version)

    def stage_weight_update(self) -> None:
        """Check the open update (`WeightTransferEngine.stage_weight_update`)."""
        self._receiver().stage_weight_update()

    def discard_weight_update(self, reason: str) -> None:
        """Fail the open update on purpose (nothing when none is open)."""
        if self.receiver is not None:
            self.receiver.discard_weight_update(reason)

    def fail_update(self, reason: str) -> None:
        """Fail the open update because another rank of this engine failed it (rolled back
        where enabled); nothing when none is open."""
        if self.receiver is not None:
            self.receiver.fail_update(reason)

    def commit(self, previous_version: str) -> None:
        """Make a staged update live (between two steps)."""
        if self.staging is not None:
            self.staging.commit(previous_version)

    def reserve_rollback(self, *, hold: bool = True) -> None:
        """Check this rank can roll back and hold it ready (`StagedWeights.reserve_rollback`);
        `rollback_weights(reserved=True)` or `release_rollback` follows."""
        if self.staging is None:
            raise LifecycleError("rollback_weights needs staged updates "
                                 "(update_staging='swap')")
        self.staging.reserve_rollback(hold=hold)

    def rollback_weights(self, *, reserved: bool = False) -> None:
        """Swap the previous version back in (staged swap updates)."""
        if not reserved:
            self.reserve_rollback(hold=False)
        assert self.staging is not None
        if self.receiver is not None:  # (first: no update may start on the old base)
            self.receiver.forget_delta_base()  # the weights are no update's any more
        self.staging.rollback(reserved=True)

    def release_rollback(self) -> None:
        """Give up a reservation: another rank cannot roll back."""
        assert self.staging is not None
        self.staging.release_rollback()

    def info(self) -> dict[str, Any]:
        """This worker's update state and bytes."""
        receiver = self.receiver
        return {"worker": self.worker_index,
                "update_state": receiver.state.value if receiver else "none",
                "update_bytes": receiver.update_bytes if receiver else 0,
                "last_update_bytes": receiver.last_update_bytes if receiver else 0,
                "kept_bytes": self.kept_bytes,
                "torn": bool(receiver and receiver.torn),
                "failure": receiver.failure if receiver else None}

    def shutdown(self) -> None:
        """Release the receiver."""
        if self.receiver is not None:
            self.receiver.shutdown()

    def release(self) -> None:
        """Drop the weights and the shadow (after `shutdown`, the model never runs again)."""
        if self.staging is not None:
            self.staging.shadow.clear()
        release_module(self.model)
