"""Trainer side of the NCCL backend: rank 0, packs buckets and broadcasts them."""

from __future__ import annotations

import secrets
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from wtransfer.errors import ConfigError, LifecycleError, TransferTimeout
from wtransfer.infos import receiver_init_dict
from wtransfer.packing import CHECKSUM_BYTES, BucketPacker, BucketPlan, metas_to_wire
from wtransfer.sender import TrainerTransferEngine, WeightSyncClient
from wtransfer.sending import await_receivers, root_cause
from wtransfer.source import WeightSource
from wtransfer_nccl.group import Group, Pending, make_group, rendezvous
from wtransfer_nccl.info import NCCLTrainerInitInfo


class NCCLSender(TrainerTransferEngine[NCCLTrainerInitInfo]):
    """Rank 0 of the group; `send_weights` overlaps packing bucket k+1 with broadcasting k.

    The receivers' `update_weights` calls run concurrently with the broadcast (they block in
    their receive loop); a receiver failure stops the broadcast at once and surfaces here as
    the receiver's `PeerError`. After any failure the group is torn down: build a new sender.
    """

    backend_name = "nccl"
    init_info_cls = NCCLTrainerInitInfo

    def __init__(self, init_info: NCCLTrainerInitInfo, *, client: WeightSyncClient,
                 source: WeightSource) -> None:
        super().__init__(init_info, client=client, source=source)
        self.device = self._staging_device(self.init_info.device)
        self.transport = "nccl" if self.device.type == "cuda" else "gloo"
        self._session = secrets.token_hex(8)
        self._group: Group | None = None
        self._broken: str | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="wtransfer-nccl")
        self._staging: list[torch.Tensor] = []

    def _connect(self) -> dict[str, Any]:
        info = self.init_info
        workers = self.client.num_workers()
        if 1 + workers != info.world_size:
            raise ConfigError(f"world_size={info.world_size}, but the trainer plus "
                              f"{workers} worker(s) make {1 + workers}; set "
                              f"world_size={1 + workers}")
        self._staging = [torch.empty(info.bucket_bytes + CHECKSUM_BYTES, dtype=torch.uint8,
                                     device=self.device) for _ in range(info.num_buffers)]
        return receiver_init_dict(info, master_address=info.master_address,
                                  master_port=info.master_port, world_size=info.world_size,
                                  rank_offset=1, transport=self.transport,
                                  session=self._session, direct_threshold=self.direct_threshold)

    @property
    def direct_threshold(self) -> int:
        """Tensors this large are broadcast straight from the source into the destination.

        Default: 1 MiB over gloo (TCP is the bottleneck, staging copies only cost CPU) and a
        quarter bucket over NCCL (below that, per-call latency favors packing). Checksums need
        staging, so they turn it off.
        """
        info = self.init_info
        if info.checksum:
            return 0
        if info.direct_threshold is not None:
            return info.direct_threshold
        return 1 << 20 if self.transport == "gloo" else max(info.bucket_bytes // 4, 1)

    def _init_receivers(self, receiver_init: dict[str, Any]) -> None:
        """Form the group on a helper thread while every engine joins it from its init call;
        engine e's workers get ranks 1 + (workers of the engines before it) + j."""
        info = self.init_info
        made: dict[str, Any] = {}

        def form() -> None:
            try:
                store = rendezvous(info.master_address, info.master_port, 0, self._session,
                                   info.timeout_s)
                made["group"] = make_group(self.transport, store, 0, info.world_size,
                                           info.timeout_s, self.device)
            except BaseException as exc:
                made["error"] = exc

        former = threading.Thread(target=form, name="wtransfer-nccl-rendezvous", daemon=True)
        former.start()
        self.client.init_each_engine(
            lambda first, _count: {**receiver_init, "rank_offset": 1 + first})
        former.join(info.timeout_s)
        if former.is_alive():
            raise TransferTimeout(f"the group of {info.world_size} ranks did not form within "
                                  f"{info.timeout_s:g}s")
        if "error" in made:
            raise made["error"]
        self._group = made["group"]

    def _send(self, plan: BucketPlan) -> None:
        if self._broken or self._group is None:
            raise LifecycleError(f"nccl sender is unusable after an earlier failure "
                                 f"({self._broken}); create a new one with trainer_init")
        group = self._group
        timeout = self.init_info.timeout_s
        receivers: Future[None] = self._pool.submit(
            self.client.update_weights, {"tensors": metas_to_wire(plan.metas)})

        def receivers_failed() -> None:
            if receivers.done() and receivers.exception() is not None:
                raise receivers.exception()  # type: ignore[misc]

        try:
            self._broadcast_all(plan, group, receivers_failed)
            await_receivers(receivers, timeout)
        except BaseException as exc:
            self._broken = f"{type(exc).__name__}: {exc}"
            group.abort()
            cause = root_cause(receivers, exc)
            if cause is not exc:
                raise cause from exc
            raise

    def _broadcast_all(self, plan: BucketPlan, group: Group,
                       receivers_failed: Callable[[], None]) -> None:
        """Post every bucket's broadcast, `num_buffers` in flight: packing the next bucket (or
        nothing, for a direct one) overlaps the broadcasts already posted."""
        info = self.init_info
        packer = BucketPacker(plan, self.source.tensors())
        free = deque(range(len(self._staging)))
        inflight: deque[tuple[int, Pending]] = deque()

        def retire_oldest() -> None:
            slot, pending = inflight.popleft()
            pending.wait(info.timeout_s, receivers_failed)
            if slot >= 0:
                free.append(slot)

        for bucket in plan.buckets:
            while len(inflight) >= len(self._staging) or not (bucket.direct or free):
                retire_oldest()
            if bucket.direct:
                slot, data = -1, packer.direct(bucket)
            else:
                slot = free.popleft()
                data = packer.pack_framed(bucket, self._staging[slot], info.checksum)
            inflight.append((slot, group.broadcast(data)))
        packer.finish()
        while inflight:
            retire_oldest()

    def _abort_remote(self, exc: BaseException) -> None:
        """Receivers learn of a failure from the torn-down group; no extra call needed."""

    def _close(self) -> None:
        group, self._group = self._group, None
        if group is not None:
            group.abort() if self._broken else group.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._staging = []
