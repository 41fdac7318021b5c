"""The trainer side of the lifecycle: the `WeightSyncClient` protocol and the sender ABC.

A sender is built in two steps: a plain constructor that declares every field (so teardown
works from any point), then `connect()`, the one step that does I/O: allocate staging, form
groups, and send each receiver its init info through the client. `TrainerTransferEngine.
trainer_init` (and `wtransfer.trainer_init`) does both and cleans up if `connect` fails.

Sharded trainers. When the source is sharded (FSDP2 / DTensor), a rank passes `client=None`,
or `process_group=` is given, every trainer rank runs `trainer_init` and `send_weights`
together (`TrainerGroup`). Ranks with a client send; the bucket plan is split across them
(`BucketPlan.owners`); the first sender drives start, the tensor list and finish. Every rank
walks every bucket so that sharded tensors are gathered bucket by bucket (`GatheringPacker`),
and after each step all ranks agree on the outcome, so they fail together.
"""

from __future__ import annotations

import contextlib
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, ClassVar, Generic, Protocol, TypeVar

import torch

from wtransfer.errors import ConfigError, LifecycleError, SenderReplacedError, TransferTimeout
from wtransfer.packing import Bucket, BucketPacker, BucketPlan, TensorMeta, metas_to_wire
from wtransfer.protocol import CallQueue, WeightSyncClient
from wtransfer.records import TrainerInitInfo, TransferStats, check_version, new_sender_id
from wtransfer.trainer.calls import UpdateCalls
from wtransfer.trainer.gather import GatheringPacker
from wtransfer.trainer.group import TrainerGroup
from wtransfer.trainer.source import WeightSource
from wtransfer.wire import digest, parse_record

TInitT = TypeVar("TInitT", bound=TrainerInitInfo)
S = TypeVar("S", bound="TrainerTransferEngine[Any]")
T = TypeVar("T")

@dataclass(frozen=True)
class Share:
    """What one sender moves of an update: its buckets of `plan`, in order, and the packer
    that fills them (which also takes part in the other senders' gathers)."""

    plan: BucketPlan
    buckets: tuple[Bucket, ...]
    packer: BucketPacker | GatheringPacker
    index: int
    """This sender's index among the senders (0 drives the control plane)."""
    count: int
    """How many senders share the plan."""

    @property
    def lead(self) -> bool:
        """Whether this sender drives the control plane."""
        return self.index == 0


class SentOnce(Protocol):
    """What a backend gave its receivers to keep across updates (IPC handles, remote keys):
    kept once an update lands, sent again in full after one fails."""

    def confirm(self) -> None:
        """The update landed: the receivers hold everything it carried."""

    def forget(self) -> None:
        """The update failed: send everything again next time."""


class TrainerTransferEngine(ABC, Generic[TInitT]):
    """Sender ABC: construct, `connect()`, then `send_weights` any number of times.

    Subclasses declare their fields in `__init__` (calling this one first) and implement
    `_connect` (allocate, return the receiver init info), `_send` and `_close`; backends that
    support several senders also `_merge` the senders' init infos (and may `_announce`).
    """

    backend_name: ClassVar[str]
    init_info_cls: ClassVar[type]
    pipelined: ClassVar[bool] = False
    """Whether `_send` issues its update calls through `self.update_calls`: they then follow
    the start without waiting for it. A backend that calls `self.client` itself (the
    simplest third-party kind) leaves this False and gets the start confirmed first."""

    def __init__(self, init_info: TInitT, *, client: WeightSyncClient | None,
                 source: WeightSource, process_group: Any = None) -> None:
        if not isinstance(source, WeightSource):
            hint = ("wrap it: source=wtransfer.ModuleSource(model)"
                    if isinstance(source, torch.nn.Module) else
                    "give a WeightSource such as wtransfer.ModuleSource(model)")
            raise ConfigError(f"source must be a WeightSource, got {type(source).__name__}: "
                              f"{hint}")
        if isinstance(init_info, TrainerInitInfo) and not isinstance(init_info,
                                                                     self.init_info_cls):
            raise ConfigError(f"the {self.backend_name} sender got a "
                              f"{type(init_info).__name__}; use "
                              f"{self.init_info_cls.__name__}")
        self.init_info: TInitT = parse_record(self.init_info_cls, init_info,
                                              where=f"{self.backend_name} trainer init info")
        self.client = client
        self.source = source
        self.process_group = process_group
        self.collective = process_group is not None or client is None or source.sharded
        """Whether every trainer rank sends together (see the module docstring)."""
        self.group: TrainerGroup | None = None
        self._last_plan: tuple[tuple[TensorMeta, ...], BucketPlan] | None = None
        self._listed: tuple[BucketPlan, list[Any], str] | None = None
        self._owned: tuple[BucketPlan, list[int], tuple[Bucket, ...]] | None = None
        self.calls = CallQueue(client) if client is not None else None
        """This rank's control calls, issued without waiting for each reply."""
        self.update_calls: UpdateCalls | None = None
        """The calls of the update in progress (None outside `send_weights`, and on a rank
        without a client)."""
        self.receivers_hold: str | None = None
        """Digest of the tensor list the receivers got in this sender's last successful
        update that offered one (`listed_tensors`)."""
        self._offered: str | None = None
        """Digest of the list the update in progress offered (held once it succeeds)."""
        self.sender_id = new_sender_id()
        """This sender's identity: every receiver init info and update call carries it, so
        receivers refuse this sender's calls once a newer `trainer_init` replaced it (with
        several trainer ranks, the lead's, agreed at connect)."""
        self.replaced: str | None = None
        """Why the receivers refused this sender as replaced by a newer one (every later
        `send_weights` raises `SenderReplacedError` at once)."""
        self.connected = False
        self.closed = False

    @classmethod
    def trainer_init(cls: type[S], init_info: Any, *, client: WeightSyncClient | None,
                     source: WeightSource, process_group: Any = None) -> S:
        """Construct and connect; a failed connect releases what it had acquired."""
        sender = cls(init_info, client=client, source=source, process_group=process_group)
        try:
            sender.connect()
        except BaseException:
            sender.shutdown()
            raise
        return sender

    @property
    def sender_index(self) -> int | None:
        """This rank's index among the senders (None: it only helps gather)."""
        return self.group.sender_index if self.group is not None else 0

    @property
    def senders(self) -> int:
        """How many trainer ranks send."""
        return len(self.group.senders) if self.group is not None else 1

    @property
    def lead(self) -> bool:
        """Whether this rank drives the control plane (start, tensor list, finish)."""
        return self.sender_index == 0

    def _together(self, step: Callable[[], T]) -> T | None:
        """Run `step` here, then agree with the other trainer ranks: every rank raises the
        first failure of any rank."""
        result, error = None, None
        try:
            result = step()
        except BaseException as exc:
            error = exc
        if self.group is not None:
            self.group.verdict(error)
        elif error is not None:
            raise error
        return result

    def connect(self) -> None:
        """Allocate staging, form groups, and initialize every receiver behind the client."""
        if self.closed or self.connected:
            raise LifecycleError(f"{self.backend_name} sender is "
                                 f"{'shut down' if self.closed else 'already connected'}")
        if self.collective:
            self.group = TrainerGroup(self.process_group, has_client=self.client is not None,
                                      timeout_s=self.init_info.timeout_s,
                                      senders=self.init_info.senders)
        fragment = self._together(lambda: {**self._connect(), "sender_id": self.sender_id}
                                  if self.client else None)
        gathered = [fragment] if self.group is None else self.group.all_gather_records(fragment)
        fragments: list[dict[str, Any]] = [f for f in gathered if f is not None]
        merged = self._merge(fragments)
        self.sender_id = str(fragments[0]["sender_id"])  # the lead's: the receivers' sender
        merged = {**merged, "sender_id": self.sender_id, "backend": self.backend_name}
        self._together(lambda: self._init_receivers(merged) if self.client else None)
        self._together(lambda: self._after_init() if self.client else None)
        self.connected = True

    def send_weights(self, weight_version: str | None = None) -> TransferStats:
        """Send every tensor of the source: start -> update(s) -> finish on the client (with
        a sharded source or several senders: on every trainer rank, together)."""
        if self.closed or not self.connected:
            raise LifecycleError(f"{self.backend_name} sender is "
                                 f"{'shut down' if self.closed else 'not connected'}")
        if self.replaced is not None:
            raise SenderReplacedError(self.replaced)
        if weight_version is not None:
            check_version(weight_version)  # before any byte moves, not at finish
        try:
            return self._send_update(weight_version)
        except SenderReplacedError as exc:
            self.replaced = str(exc)  # for good: the receivers serve a newer sender now
            raise

    def _send_update(self, weight_version: str | None) -> TransferStats:
        """One update: start, every rank's share, finish (see `send_weights`)."""
        start = time.perf_counter()
        self._offered = None
        calls = self.update_calls = (UpdateCalls(self.calls, self.init_info.timeout_s,
                                                 weight_version, self.sender_id)
                                     if self.calls is not None else None)
        try:
            if self.lead and calls is not None:
                calls.start()  # the engine opens the update while this rank plans it
            try:
                metas = self.source.metadata()
                plan = self._plan(metas)
                owners, mine = self._owners(plan)
                packer: BucketPacker | GatheringPacker = (
                    GatheringPacker(plan, self.source.parts(), owners, self.group.senders)
                    if self.source.sharded and self.group is not None
                    else BucketPacker(plan, self.source.tensors()))
                self._together(lambda: self._open(plan) if self.lead else None)
                index = self.sender_index
                self._together(lambda: self._move(Share(
                    plan, mine, packer, index if index is not None else -1, self.senders)))
            except BaseException as exc:
                if self.lead:
                    self._abort_remote(exc)
                raise
            self._together(lambda: self._close_update() if self.lead and calls else None)
            if self._offered is not None:  # the receivers hold the list it gave them
                self.receivers_hold = self._offered
        finally:
            if calls is not None:
                calls.drop()
            self.update_calls = None
        seconds = time.perf_counter() - start
        peak = packer.peak_bytes if isinstance(packer, GatheringPacker) else 0
        return TransferStats(plan.total_bytes, len(metas), len(plan.buckets), seconds, peak)

    def _plan(self, metas: list[TensorMeta]) -> BucketPlan:
        """The bucket plan of `metas` (the last one again when nothing changed: a trainer
        sends the same tensor list every step)."""
        key = tuple(metas)
        if self._last_plan is None or self._last_plan[0] != key:
            self._last_plan = (key, BucketPlan.build(metas, self.init_info.bucket_bytes,
                                                     direct_threshold=self.direct_threshold))
        return self._last_plan[1]

    def _owners(self, plan: BucketPlan) -> tuple[list[int], tuple[Bucket, ...]]:
        """Which sender moves each bucket of `plan`, and this rank's buckets (worked out again
        only for a new plan)."""
        if self._owned is None or self._owned[0] is not plan:
            owners = plan.owners(self.senders)
            mine = tuple(b for b, o in zip(plan.buckets, owners, strict=True)
                         if o == self.sender_index)
            self._owned = (plan, owners, mine)
        return self._owned[1], self._owned[2]

    def tensor_list(self, plan: BucketPlan) -> tuple[list[Any], str]:
        """`plan`'s tensor list as sent on the wire and its `wtransfer.wire.digest` (worked out
        again only for a new plan: the plan is reused while the source stays the same)."""
        if self._listed is None or self._listed[0] is not plan:
            wire_list = metas_to_wire(plan.metas)
            self._listed = (plan, wire_list, digest(wire_list))
        return self._listed[1], self._listed[2]

    def listed_tensors(self, plan: BucketPlan) -> dict[str, Any]:
        """The update fields that give the receivers `plan`'s tensor list: the list, or its
        digest once they hold it (`receivers_hold`, set when an update that offered it
        succeeds; a failed one sends the list in full next time)."""
        wire_list, list_digest = self.tensor_list(plan)
        held, self.receivers_hold = self.receivers_hold, None
        self._offered = list_digest
        return {"tensors_digest": list_digest} if held == list_digest else {"tensors": wire_list}

    def _open(self, plan: BucketPlan) -> None:
        """The lead confirms its start (issued first thing in `send_weights`) unless the
        backend pipelines its update calls behind it, and with several senders announces the
        tensor list, before any sender moves a bucket."""
        calls = self.update_calls
        assert calls is not None
        if self.senders > 1 or not self.pipelined:
            calls.settle()
        if self.senders > 1:
            self._announce(plan)

    def finish_early(self) -> None:
        """For a backend's `_send`, once every update call of this rank is issued: the lead
        of a lone sender issues finish right behind them (the engine runs it only if they
        succeed, so as soon as the data is in, saving a round trip). With several senders
        finish waits for every rank's verdict instead."""
        if self.lead and self.senders == 1 and self.update_calls is not None:
            self.update_calls.finish()

    def in_place(self, share: Share, usable: Callable[[list[torch.Tensor]], bool]
                 ) -> tuple[list[torch.Tensor] | None, Share]:
        """For a backend whose receivers read the source's tensors where they lie: those
        tensors (in the plan's order) when this is the only sender and `usable(tensors)`,
        else None; and the share to send otherwise (with a new packer when looking used up
        the source's iterator)."""
        if share.count != 1 or not isinstance(share.packer, BucketPacker):
            return None, share
        held = self.source.held()
        tensors = held if held is not None else share.packer.walk()
        if usable(tensors):
            if held is not None:
                share.packer.release()
            return tensors, share
        if held is None:
            share = replace(share, packer=BucketPacker(share.plan, self.source.tensors()))
        return None, share

    def settle_in_place(self, sent: SentOnce) -> None:
        """After the one update call of an in-place update: issue finish behind it, wait for
        the replies, and keep or drop what the call gave the receivers."""
        calls = self.update_calls
        assert calls is not None
        self.finish_early()  # start, update and finish travel together: one round trip
        try:
            calls.settle()
        except BaseException:
            sent.forget()
            raise
        sent.confirm()

    def _close_update(self) -> None:
        """The lead finishes the update (unless `finish_early` did) and waits for every reply."""
        calls = self.update_calls
        assert calls is not None
        calls.finish()
        calls.settle()

    def _move(self, share: Share) -> None:
        """This rank's part: a sender moves its share; every rank takes part in the gathers of
        the buckets it does not send, even after its own part failed (so no rank waits on
        it). A failure is reported as the receivers' own error when one comes (`UpdateCalls.
        cause`)."""
        try:
            if self.client is not None:
                self._send(share)
        except BaseException as exc:
            with contextlib.suppress(Exception):  # the send's own failure is the one to report
                share.packer.finish()
            calls = self.update_calls
            cause = calls.cause(exc) if calls is not None else exc
            if cause is not exc:  # the receivers' refusal, not the broken channel it caused
                raise cause from exc
            raise
        share.packer.finish()

    def _abort_remote(self, exc: BaseException) -> None:
        """Tell receivers the update failed here, so they fail it now instead of at timeout."""
        calls = self.update_calls
        if isinstance(exc, TransferTimeout) or calls is None:
            return  # a receiver that does not answer would not answer this either
        with contextlib.suppress(Exception):  # a failed receiver's own deadline covers it
            calls.abort(f"{type(exc).__name__}: {exc}"[:1000])

    def shutdown(self) -> None:
        """Free staging buffers and connections; idempotent."""
        if not self.closed:
            self.closed = True
            self._close()
            if self.calls is not None:
                self.calls.close()
            if self.group is not None:
                self.group.close()

    def __enter__(self: S) -> S:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    @property
    def direct_threshold(self) -> int:
        """Bytes from which a tensor becomes a direct bucket; 0 (never) unless a backend
        that can move tensors in place overrides it (never with a sharded source, whose
        tensors are gathered into staging)."""
        return 0

    def _resolve_direct_threshold(self, default: int) -> int:
        """For a backend that can move tensors in place: off (0) with checksums or a sharded
        source (both need staging), else the init info's `direct_threshold`, else `default`."""
        info = self.init_info
        if info.checksum or self.source.sharded:
            return 0
        return default if info.direct_threshold is None else info.direct_threshold

    def _staging_device(self, override: str | None) -> torch.device:
        """Where staging lives: the init info's `device` when given, else the source's."""
        if override:
            return torch.device(override)
        return self.source.device or torch.device("cpu")

    @abstractmethod
    def _connect(self) -> dict[str, Any]:
        """Allocate staging (and listen, where the backend does); return the receiver init
        info as plain data."""

    def _init_receivers(self, receiver_init: dict[str, Any]) -> None:
        """The lead sends the merged receiver init info through its client (override to vary
        it per engine, or to join groups on every sender)."""
        if self.lead and self.client is not None:
            self.client.init_weight_transfer_engine(receiver_init)

    def _after_init(self) -> None:
        """Runs on every sender once every receiver is initialized; optional."""

    def _merge(self, fragments: list[dict[str, Any]]) -> dict[str, Any]:
        """One receiver init info from every sender's `_connect` result (in sender order);
        a backend that supports several senders overrides this."""
        if len(fragments) != 1:
            raise ConfigError(f"{self.backend_name}: {len(fragments)} senders at once are not "
                              "supported by this backend; give one trainer rank a client")
        return fragments[0]

    def _announce(self, plan: BucketPlan) -> None:
        """With several senders: tell the receivers the update's tensor list before any
        sender moves a bucket (backends whose update info carries the list need nothing)."""

    @abstractmethod
    def _send(self, share: Share) -> None:
        """Move the buckets of `share`, issuing the update call(s) through
        `self.update_calls` (they follow the lead's start without waiting for it), and settle
        them before returning. Call `share.packer.finish()` once your own buckets are packed
        and before waiting on the receivers (with a sharded source the other senders' buckets
        need this rank's rows), and `finish_early()` once your update calls are issued."""

    @abstractmethod
    def _close(self) -> None:
        """Release what `_connect` acquired; must work after a partial or failed connect."""
