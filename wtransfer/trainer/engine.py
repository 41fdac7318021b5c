"""The sender base, `TrainerTransferEngine`: the base owns the sequence of an update.

A sender is built in two steps: a plain constructor that declares every field (so teardown
works from any point), then `connect()`, the one step that does I/O: allocate staging, form
groups, and send each receiver its init info through the client. `TrainerTransferEngine.
trainer_init` (and `wtransfer.trainer_init`) does both and cleans up if `connect` fails.

An update, as the base runs it (`send_weights`)::

    lead: start ─┐ plan the source's tensor list (one `Manifest` per list, reused)
    each sender: ├ backend `_outgoing(share)` -> `Outgoing`: an opening call, a channel, or both
                 ├ several senders: settle start, the lead announces the list (`_announce`),
                 │ unless the lead's opening call is the whole update (`Outgoing.lead_only`)
                 ├ the opening update call (lead)             ─┐ a lone sender issues finish
                 ├ the buckets through the one send loop       ├ right behind its last
                 │ (`wtransfer.transport.window.send_buckets`) ─┘ update call
                 └ settle every call in order; keep or forget what the receivers hold
    lead: finish (several senders: after every rank's verdict) and settle

A backend supplies only primitives: `_connect` / `_close`, and per update an `Outgoing` (its
opening update info, a `SendChannel` or `CallChannel` over its data plane, and what the
receivers keep). It never issues start or finish, settles calls, or orders them.

Sharded trainers. When the source is sharded (FSDP2 / DTensor), a rank passes `client=None`,
or `process_group=` is given, every trainer rank runs `trainer_init` and `send_weights`
together (`Ranks` over a `TrainerGroup`). Ranks with a client send; the bucket plan is split
across them (`BucketPlan.owners`); the first sender drives start, the tensor list and finish.
Every rank walks every bucket so that sharded tensors are gathered bucket by bucket
(`GatheringPacker`), and after each step all ranks agree on the outcome, so they fail
together. A backend that moves each rank's own shards to the workers that keep them (M->N,
`m2n`) gathers nothing: every rank sends its pair buckets (`Outgoing.units`).
"""

from __future__ import annotations

import contextlib
import logging
import time
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, Generic, Protocol, TypeVar

import torch

from wtransfer.errors import (
    ConfigError,
    LifecycleError,
    NotInitializedError,
    SenderReplacedError,
)
from wtransfer.manifest import Manifest, PlanParams
from wtransfer.packing import Bucket, BucketPacker, BucketPlan
from wtransfer.protocol import (
    CallQueue,
    PausingClient,
    StagingClient,
    WeightSyncClient,
    spin_start,
)
from wtransfer.records import (
    DEFAULT_BUCKET_BYTES,
    DEFAULT_NUM_BUFFERS,
    SENDER_LEGACY_CAPABILITIES,
    Capabilities,
    PauseMode,
    TrainerInitInfo,
    TransferStats,
    check_pause_mode,
    check_version,
    declared_capabilities,
    new_sender_id,
)
from wtransfer.trainer.calls import Role, UpdateCalls
from wtransfer.trainer.fleet import FleetUpdates
from wtransfer.trainer.gather import GatheringPacker
from wtransfer.trainer.group import Ranks, TrainerGroup
from wtransfer.trainer.layouts import OwnShardsPacker
from wtransfer.trainer.listing import TensorListing
from wtransfer.trainer.plans import SenderPlans, sized
from wtransfer.trainer.source import WeightSource
from wtransfer.trainer.updates import (
    Header,
    HoldsUpdates,
    Payload,
    Updates,
    first_updates,
    updates_for,
)
from wtransfer.transport.window import CallChannel, SendChannel, SendUnit, send_buckets
from wtransfer.wire import parse_record, record_to_wire

log = logging.getLogger("wtransfer.trainer")
TInitT = TypeVar("TInitT", bound=TrainerInitInfo)
S = TypeVar("S", bound="TrainerTransferEngine[Any]")


@dataclass(frozen=True)
class Share:
    """What one sender moves of an update: its buckets of the plan, in order, and the packer
    that fills them (which also takes part in the other senders' gathers)."""

    manifest: Manifest
    plan: BucketPlan
    buckets: tuple[Bucket, ...]
    packer: BucketPacker | GatheringPacker | OwnShardsPacker
    index: int
    """This sender's index among the senders (0 drives the control plane)."""
    count: int
    """How many senders share the plan."""
    source: WeightSource
    """What the update sends: the trainer's source, or what the update strategy chose."""
    parts: list[torch.Tensor] | None = None
    """A sharded source's parts as this rank holds them, taken on every rank at the same
    point of every update, before any rank can fail on its own (taking them may be
    collective: `Fp8Source` agrees on its scales)."""
    header: Header | None = None
    """The update's header from the update strategy (`Payload.header`), for backends
    that encode against it."""
    listing: TensorListing = field(default_factory=TensorListing)
    """The sender's record of which tensor list its receivers hold."""

    @property
    def lead(self) -> bool:
        """Whether this sender drives the control plane."""
        return self.index == 0

    def listed_tensors(self) -> dict[str, Any]:
        """The update fields that give the receivers this update's tensor list: the list,
        or its digest once they hold it (`TensorListing`)."""
        return self.listing.fields(self.manifest)

    def in_place(self, usable: Callable[[list[torch.Tensor]], bool]
                 ) -> tuple[list[torch.Tensor] | None, Share]:
        """For a backend whose receivers read the source's tensors where they lie: those
        tensors (in the plan's order) when this is the only sender and `usable(tensors)`,
        else None; and the share to send otherwise (with a new packer when looking used up
        the source's iterator)."""
        if self.count != 1 or not isinstance(self.packer, BucketPacker):
            return None, self
        held = self.source.held()
        tensors = held if held is not None else self.packer.walk()
        if usable(tensors):
            if held is not None:
                self.packer.release()
            return tensors, self
        if held is None:
            return None, replace(self, packer=BucketPacker(self.plan, self.source.tensors()))
        return None, self


class KeptByReceivers(Protocol):
    """What a backend gave its receivers to keep across updates (IPC handles, remote keys):
    kept once an update lands, sent again in full after one fails."""

    def confirm(self) -> None:
        """The update landed: the receivers hold everything it carried."""

    def forget(self) -> None:
        """The update failed: send everything again next time."""


@dataclass(frozen=True)
class Outgoing:
    """How one sender's part of an update travels (a backend's `_outgoing`)."""

    share: Share
    """What to move (a backend that read the source in place may hand a fresh packer)."""
    opening: dict[str, Any] | None = None
    """The update call the lead issues before any bucket moves: the tensor list where the
    buckets travel over the backend's own data plane, or the whole update where the receivers
    read the source in place; None when each bucket's call carries its own part."""
    channel: SendChannel[Any] | CallChannel | None = None
    """How the buckets move (None: the opening call carries the whole update)."""
    kept: KeptByReceivers | None = None
    """What the receivers keep once this update lands."""
    units: tuple[SendUnit, ...] | None = None
    """What the channel moves instead of the share's buckets (an M->N sender's pair
    buckets)."""
    lead_only: bool = False
    """The lead's opening call is the whole update, tensor list included, and no other rank
    sends anything (every rank says so alike): no announcement goes before it."""


class TrainerTransferEngine(HoldsUpdates, ABC, Generic[TInitT]):
    """Sender ABC: construct, `connect()`, then `send_weights` any number of times. Subclasses
    declare their fields in `__init__` (calling this one first) and implement `_connect`,
    `_outgoing` and `_close`; several senders also need `_merge` (docs/writing-a-backend.md)."""

    backend_name: ClassVar[str]
    init_info_cls: ClassVar[type]
    capabilities: ClassVar[Capabilities] = Capabilities()
    """What the backend can do (the same record as its receiver's)."""
    direct_threshold: int = 0
    """Bytes from which a tensor becomes a direct bucket; 0 (never) unless a backend that
    can move tensors in place sets it in its constructor (`resolve_direct_threshold`: never
    with a sharded source, whose tensors are gathered into staging)."""
    fixed_receivers: bool = True
    """Whether the transport reaches exactly the receivers it was connected to (a group,
    endpoints, per-worker events): a fleet that lost an instance must be connected again. A
    backend whose update calls alone reach the receivers sets False once it knows (at
    `_connect`)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.capabilities = declared_capabilities(cls, SENDER_LEGACY_CAPABILITIES)
        own = vars(cls)
        if "_moved" in own and "_backend_stats" not in own:  # (the hook's old name)
            warnings.warn(f"{cls.__name__} overrides `_moved`; the hook is `_backend_stats` "
                          "now", DeprecationWarning, stacklevel=2)
            cls._backend_stats = own["_moved"]  # type: ignore[method-assign]

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
        self.m2n = False
        """Whether every rank sends the workers its own shards (M->N; nothing is gathered):
        the backend decides at connect (`wtransfer.trainer.m2n_choice`)."""
        self.init_info = sized(self.init_info, self.init_info.bucket_bytes,
                               self.init_info.num_buffers, self._default_staging)
        self.ranks = Ranks(None)
        """This rank among the trainer ranks sending together (alone until `connect`)."""
        self.plans = SenderPlans()
        """Each tensor list as this sender sends it (the last one kept)."""
        self.calls = CallQueue(client) if client is not None else None
        """This rank's control calls, issued without waiting for each reply."""
        self.listing = TensorListing()
        """Which tensor list the receivers hold (`Share.listed_tensors`)."""
        self.sender_id = new_sender_id()
        """This sender's identity: every receiver init info and update call carries it, so
        receivers refuse this sender's calls once a newer `trainer_init` replaced it (with
        several trainer ranks, the lead's, agreed at connect)."""
        self._pause: tuple[PausingClient, PauseMode] | None = None
        """The lead's client and the pause the update in progress wants around its finish
        (None: no pause)."""
        self.replaced: str | None = None
        """Why the receivers refused this sender as replaced by a newer one (every later
        `send_weights` raises `SenderReplacedError` at once)."""
        self.updates: Updates = first_updates(self.init_info)
        """What each update carries, a strategy (`wtransfer.trainer.updates`; chosen again
        at connect, once it is known how this sender sends)."""
        self.connected = False
        self.closed = False
        self._last_update_s: float | None = None
        """How long the last update that succeeded took (`Role.spin_from`)."""
        self.fleet = FleetUpdates(client, self.backend_name)
        """What a fleet client needs around each update (`wtransfer.trainer.fleet`)."""

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
    def lead(self) -> bool:
        """Whether this rank drives the control plane (start, tensor list, finish)."""
        return self.ranks.lead

    @property
    def senders(self) -> int:
        """How many trainer ranks send."""
        return self.ranks.senders

    @property
    def plan_params(self) -> PlanParams:
        """How this sender lays tensor lists out in buckets (the receivers get the same)."""
        return PlanParams(bucket_bytes=self.bucket_bytes,
                          direct_threshold=self.direct_threshold)

    def connect(self) -> None:
        """Allocate staging, form groups, and initialize every receiver behind the client."""
        if self.closed or self.connected:
            raise LifecycleError(f"{self.backend_name} sender is "
                                 f"{'shut down' if self.closed else 'already connected'}")
        if self.collective:
            self.ranks = Ranks(TrainerGroup(self.process_group,
                                            has_client=self.client is not None,
                                            timeout_s=self.init_info.timeout_s,
                                            senders=self.init_info.senders))
            agree_on_init_info(self.ranks, self.init_info)

        def on_senders(step: Callable[[], Any]) -> Any:  # then agree with every rank
            return self.ranks.together(step if self.client is not None else lambda: None)

        fragment = on_senders(lambda: {**self._connect(), "sender_id": self.sender_id})
        fragments: list[dict[str, Any]] = [f for f in self.ranks.gather(fragment)
                                           if f is not None]
        ways = [f.get("m2n") for f in fragments]
        if len(set(ways)) > 1:  # (each sender decides alone, from its own init info)
            raise ConfigError(f"the sending ranks disagree on going M->N (by rank: {ways}); "
                              "pass the same m2n, and the same device, on every rank")
        merged = self._merge(fragments)
        self.sender_id = str(fragments[0]["sender_id"])  # the lead's: the receivers' sender
        self.updates = updates_for(self.updates, self.init_info, backend=self.backend_name,
                                   collective=self.collective,
                                   own_shards=self.m2n,
                                   capabilities=self.capabilities)
        merged = {**merged, "sender_id": self.sender_id, "backend": self.backend_name,
                  "plan": record_to_wire(self.plan_params)}
        on_senders(lambda: self._init_receivers(merged))
        on_senders(self._after_init)
        self.fleet.connected()
        self.connected = True

    def send_weights(self, weight_version: str | None = None, *,
                     pause: PauseMode | None = None) -> TransferStats:
        """Send every tensor of the source: start -> update(s) -> finish (with a sharded source or
        several senders, on every trainer rank together). With `pause` ("keep", "wait", "abort")
        on a client that can pause, the engine is paused only around the finish, once every byte
        arrived, and resumed after it."""
        if self.closed or not self.connected:
            raise LifecycleError(f"{self.backend_name} sender is "
                                 f"{'shut down' if self.closed else 'not connected'}")
        if self.replaced is not None:
            raise SenderReplacedError(self.replaced)
        if weight_version is not None:
            check_version(weight_version)  # before any byte moves, not at finish
        self._pause = None
        if pause is not None and self.lead:
            client = self.client
            if not isinstance(client, PausingClient):
                raise ConfigError(f"send_weights(pause={pause!r}) needs a client that can "
                                  f"pause its engine; {client!r} cannot")
            self._pause = (client, check_pause_mode(pause))
        def send() -> TransferStats:
            return self.updates.send(self.source,
                                     lambda payload: self._send_update(weight_version, payload))

        try:
            try:
                self.fleet.follow(fixed_receivers=self.fixed_receivers,
                                  collective=self.collective, reconnect=self._reconnect)
                stats = self.fleet.send(send, collective=self.collective,
                                        reconnect=self._reconnect)
                return self.fleet.report(stats, weight_version)
            except NotInitializedError as exc:
                if self.collective:
                    raise NotInitializedError(
                        f"{exc}; the engine restarted since these trainer ranks' trainer_init: "
                        "create the senders again on every rank (their first update is "
                        "sent in full)") from exc
                log.warning("%s: the engine holds no sender (it restarted?): initializing "
                            "it again and sending in full", self.backend_name)
                self._reconnect()
                return send()
        except SenderReplacedError as exc:
            self.replaced = str(exc)  # for good: the receivers serve a newer sender now
            raise

    def _reconnect(self) -> None:
        """Rebuild the backend's side of the transport and initialize the receivers again,
        as a new sender (their engine restarted, or the fleet changed); the next update is
        sent in full."""
        self._close()
        self.connected = False
        self.listing.forget()
        self.sender_id = new_sender_id()  # late calls of the last connection: refused
        self.updates.forget()
        self.connect()

    def _send_update(self, weight_version: str | None, payload: Payload) -> TransferStats:
        """One update of `payload`, in the order of the module docstring (its first call, if
        any, right behind start, answered before any byte moves when it asks so)."""
        start = time.monotonic()
        self.listing.update_started()
        source = payload.source
        client = self.client
        role = Role(lead=self.lead, senders=self.senders, pause=self._pause,
                    staging=client if isinstance(client, StagingClient) else None,
                    spin_from=spin_start(start, self._last_update_s))
        calls = (UpdateCalls(self.calls, self.init_info.timeout_s, weight_version,
                             self.sender_id, role) if self.calls is not None else None)
        try:
            if self.lead and calls is not None:
                calls.start()  # (several senders: the engine opens it while they plan;
                # a lone one's goes with its first update call where its client batches)
                if payload.first_call is not None:
                    calls.update(payload.first_call)
            if payload.answer_first:  # every rank learns of a refusal
                self.ranks.together(lambda: calls.settle_first() if calls else None)
            try:
                layout = self.plans.of(source.metadata(), self.plan_params, self.senders,
                                       self.ranks.sender_index)
                group = self.ranks.group
                parts = list(source.parts()) if source.sharded and group is not None else None
                packer: BucketPacker | GatheringPacker | OwnShardsPacker = (
                    OwnShardsPacker() if self.m2n
                    else GatheringPacker(layout.plan, parts, layout.owners, group.senders)
                    if parts is not None and group is not None
                    else BucketPacker(layout.plan, source.tensors()))
                index = self.ranks.sender_index
                share = Share(layout.manifest, layout.plan, layout.mine, packer,
                              index if index is not None else -1, self.senders, source,
                              parts, payload.header, self.listing)
                out = self._plan_outgoing(share, calls)
                self.ranks.together(lambda: self._open(share.manifest, calls, out))
                try:
                    self.ranks.together(lambda: self._move(share, out, calls))
                except BaseException as exc:  # every rank: a peer's failed part leaves this
                    if calls is None or not calls.refused_at_finish:  # update's channels as
                        self._failed(exc)  # unusable as its own (and all ranks then refuse
                    raise  # the next update alike, none waiting in a gather)
            except BaseException as exc:
                if self.lead and calls is not None:
                    calls.abort_for(exc)
                raise
            self.ranks.together(lambda: calls.close() if calls else None)
            self.listing.update_landed()  # the receivers hold the list it gave them
        finally:
            if calls is not None:
                calls.drop()
        seconds = self._last_update_s = time.monotonic() - start
        peak = packer.peak_bytes if isinstance(packer, GatheringPacker) else 0
        fields: dict[str, Any] = {"bytes": layout.plan.total_bytes,
                                  "tensors": len(layout.manifest),
                                  "buckets": len(layout.plan.buckets), "seconds": seconds,
                                  "gathered_peak_bytes": peak}
        return TransferStats(**{**payload.stats_fields(fields), **self._backend_stats()})

    def _plan_outgoing(self, share: Share, calls: UpdateCalls | None) -> Outgoing | None:
        """Every rank works out its `Outgoing` (None: a rank without a client, which only
        helps gather) and the ranks agree; where one failed, every rank's backend hears of it
        (`_failed`), as after a failed move, and the receivers' own error is raised where one
        came (`UpdateCalls.cause`)."""
        try:
            return self.ranks.together(
                lambda: self._outgoing(share) if calls is not None else None)
        except BaseException as exc:
            cause = self._part_failed(share, calls, exc)
            if cause is not exc:  # the receivers' refusal (of start, say) says why
                raise cause from exc
            raise

    def _open(self, manifest: Manifest, calls: UpdateCalls | None,
              out: Outgoing | None) -> None:
        """With several senders, before any sender moves a bucket: the lead confirms its
        start and the receivers get the tensor list (`_announce`; a `lead_only` call carries
        it), so no sender's bucket call reaches an engine that has not opened the update."""
        if self.senders == 1 or calls is None or not self.lead:
            return
        calls.settle()
        if out is not None and out.lead_only:
            return
        announcement = self._announce(manifest)
        if announcement is not None:
            self.listing.sent(manifest)
            calls.update(announcement)
            calls.settle()

    def _move(self, share: Share, out: Outgoing | None, calls: UpdateCalls | None) -> None:
        """This rank's part: a sender moves its share; every rank takes part in the gathers of
        the buckets it does not send, even after its own part failed (so no rank waits on
        it). A failure is reported as the receivers' own error when one comes (`UpdateCalls.
        cause`)."""
        try:
            if out is not None and calls is not None:  # a rank with a client sends
                self._deliver(out, calls)
        except BaseException as exc:
            if calls is not None and calls.refused_at_finish:
                with contextlib.suppress(Exception):  # (the refusal is the one to report)
                    share.packer.finish()
                raise  # every byte moved: the channel is as good as after a success
            cause = self._part_failed(share, calls, exc)
            if cause is not exc:  # the receivers' refusal, not the broken channel it caused
                raise cause from exc
            raise
        share.packer.finish()

    def _part_failed(self, share: Share, calls: UpdateCalls | None,
                     exc: BaseException) -> BaseException:
        """This rank's part failed (`exc`): finish its packer's gathers, tell the backend
        (`_failed`); the error to raise, the receivers' own where one came
        (`UpdateCalls.cause`)."""
        with contextlib.suppress(Exception):  # (the failure is the one to report)
            share.packer.finish()
        self._failed(exc)
        return calls.cause(exc) if calls is not None else exc

    def _deliver(self, out: Outgoing, calls: UpdateCalls) -> None:
        """Issue `out`'s update calls and move its buckets; a lone sender's finish follows its
        last update call (the engine runs it only once they succeeded: no round trip of its
        own). Then settle every call in order and keep or forget what the receivers hold."""
        share = out.share
        if out.opening is not None and share.lead:
            calls.update(out.opening)
        units = share.buckets if out.units is None else out.units
        if isinstance(out.channel, CallChannel):  # each bucket's call, then finish
            send_buckets(units, share.packer, calls.through(out.channel,
                                                            self.init_info.checksum,
                                                            len(units)),
                         check=calls.check, all_posted=calls.finish_behind_updates)
        else:
            calls.finish_behind_updates()  # every update call of this rank is issued
            calls.release()  # (the receivers must hear of the update before bytes move)
            if out.channel is not None:
                send_buckets(units, share.packer, out.channel, check=calls.check)
        try:
            calls.settle(calls.role.spin_from)
        except BaseException:
            if out.kept is not None:
                out.kept.forget()
            raise
        if out.kept is not None:
            out.kept.confirm()

    def shutdown(self) -> None:
        """Free staging buffers and connections; idempotent."""
        if not self.closed:
            self.closed = True
            self._close()
            if self.calls is not None:
                self.calls.close()
            self.ranks.close()

    def __enter__(self: S) -> S:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def _backend_stats(self) -> dict[str, Any]:
        """Fields of the last update's `TransferStats` only the backend knows (M->N: its pair
        buckets, bytes this rank sent, bytes each worker received); optional."""
        return {}

    @property
    def bucket_bytes(self) -> int:
        """This sender's staging bucket capacity (the init info's, or the backend's choice)."""
        assert self.init_info.bucket_bytes is not None  # resolved in __init__
        return self.init_info.bucket_bytes

    @property
    def num_buffers(self) -> int:
        """This sender's staging buffers (the init info's, or the backend's choice)."""
        assert self.init_info.num_buffers is not None  # resolved in __init__
        return self.init_info.num_buffers

    def _default_staging(self, bucket_bytes: int | None) -> tuple[int, int]:
        """The bucket capacity and the number of staging buffers where the init info names
        none (`bucket_bytes`: the capacity it names, if any); override per staging."""
        return DEFAULT_BUCKET_BYTES, DEFAULT_NUM_BUFFERS

    # -- backend hooks -------------------------------------------------------------------

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

    def _announce(self, manifest: Manifest) -> dict[str, Any] | None:
        """With several senders: the update info that gives the receivers the tensor list
        before any sender moves a bucket (None for backends whose opening call carries it)."""
        return None

    @abstractmethod
    def _outgoing(self, share: Share) -> Outgoing:
        """How this sender's part of an update travels (see `Outgoing`); called once per
        update on every sender, after the lead's start was issued and before it is settled
        or the list announced (so it may gather among the ranks, never call the engine)."""

    def _failed(self, exc: BaseException) -> None:
        """An update's transfer failed (`exc`), on this rank or another (every rank of a group
        is told; the failing one may be told twice): drop what cannot be reused (a torn-down
        group, messages or reads in flight); optional."""

    @abstractmethod
    def _close(self) -> None:
        """Release what `_connect` acquired; must work after a partial or failed connect."""


def resolve_direct_threshold(info: TrainerInitInfo, source: WeightSource, default: int) -> int:
    """A `direct_threshold` for a backend that can move tensors in place: off (0) with
    checksums or a sharded source (both need staging), else the init info's
    `direct_threshold`, else `default`."""
    if info.checksum or source.sharded:
        return 0
    return default if info.direct_threshold is None else info.direct_threshold


def agree_on_init_info(ranks: Ranks, info: TrainerInitInfo) -> None:
    """Every rank's init info must equal every other's but for its per-rank fields
    (`TrainerInitInfo.per_rank_fields`): ranks that disagree are all told the same
    (`ConfigError`), naming the fields and each rank's value, before any of them connects."""
    shared = {k: v for k, v in record_to_wire(info).items() if k not in info.per_rank_fields}
    infos = ranks.gather(shared)
    differ = sorted({k for each in infos for k in {*each, *infos[0]}
                     if each.get(k) != infos[0].get(k)})
    if differ:
        values = "; ".join(f"{k}: {[each.get(k) for each in infos]}" for k in differ[:4])
        raise ConfigError(f"the trainer ranks' {type(info).__name__}s differ in {differ} "
                          f"(by rank: {values}); every rank that sends together must pass the "
                          "same values")
