"""The engine side of the lifecycle: `WeightTransferEngine`, the receiver ABC.

State machine (one receiver per model worker)::

    new --init--> ready --start--> updating --finish--> ready
                    ^                  |  error / sender abort / abandoned
                    |                  v
                    +---- start --- failed          (any state) --shutdown--> closed

`init` may be repeated from any state but closed: new wire parameters replace the old ones,
and an update still open is failed first (its sender is gone: a new one is initializing).
Public methods are template methods: parse dicts into the backend's dataclasses, check the
state, then call the backend's ``_init / _start / _receive / _finish / _shutdown`` hooks.
An update whose sender makes no call for `timeout_s` is failed by a deadline timer (a thread
of its own), so an engine never waits forever on a trainer that died; a backend that can
tell its sender is gone (`Capabilities.sender_check_s`, `_sender_gone`) fails it as soon as
it knows.
Reading `state` never changes it.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any, ClassVar, Generic, TypeVar

import torch

from wtransfer.errors import (
    ConfigError,
    LifecycleError,
    NotInitializedError,
    PeerError,
    SenderReplacedError,
)
from wtransfer.manifest import Manifests
from wtransfer.receiver.deadline import DeadlineTimer
from wtransfer.receiver.lineage import HoldsLineage, Lineage
from wtransfer.receiver.programs import PiecePrograms
from wtransfer.receiver.session import UpdateSession
from wtransfer.receiver.target import WeightTarget
from wtransfer.records import (
    Capabilities,
    ReceiverInitInfo,
    UpdateInfo,
    check_version,
    declared_capabilities,
)
from wtransfer.wire import parse_record

log = logging.getLogger("wtransfer.receiver.engine")
InitT = TypeVar("InitT", bound=ReceiverInitInfo)
UpdateT = TypeVar("UpdateT", bound=UpdateInfo)


class ReceiverState(str, enum.Enum):
    """Where a receiver is in its lifecycle (compares equal to its lowercase name)."""

    NEW = "new"
    READY = "ready"
    UPDATING = "updating"
    FAILED = "failed"
    CLOSED = "closed"


_HINTS = {
    ReceiverState.NEW: "call init_transfer_engine first",
    ReceiverState.CLOSED: "this engine was shut down; create a new one",
    ReceiverState.UPDATING: "an update is open; finish it first",
    ReceiverState.FAILED: "the last update failed ({failure}); call start_weight_update",
    ReceiverState.READY: "call start_weight_update first",
}


class WeightTransferEngine(HoldsLineage, ABC, Generic[InitT, UpdateT]):
    """Receiver ABC (see the module docstring for the state machine)."""

    backend_name: ClassVar[str]
    init_info_cls: ClassVar[type]
    update_info_cls: ClassVar[type]
    capabilities: ClassVar[Capabilities] = Capabilities()
    """What the backend can do (the same record as its sender's)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.capabilities = declared_capabilities(cls, {
            "calls_read_sender_memory": "calls_read_sender_memory",
            "sender_check_s": "sender_check_s"})

    def __init__(self, target: WeightTarget, *, device: str | torch.device = "cpu",
                 worker_index: int = 0, rollback: bool = False) -> None:
        self.target = target
        self.rollback = rollback
        """Keep each overwritten tensor's old value (host memory) during an update and restore
        them all when the update fails or is abandoned: the target is then never torn."""
        self._rollback_store: dict[str, torch.Tensor] = {}
        """Host buffers of the rollback copies, kept across updates (one model's worth)."""
        self._programs = PiecePrograms()
        """M->N buckets' copies, worked out once and replayed (`wtransfer.receiver.programs`)."""
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.worker_index = worker_index
        """Index of this receiver among its engine's workers (a data-parallel engine's rank);
        collective backends derive the receiver's group rank from it."""
        self.init_info: InitT | None = None
        self.failure: str | None = None
        """Why the last update failed, while the state is FAILED."""
        self.failures = 0
        """How many updates failed here so far (an engine's ranks notice a new failure by it)."""
        self.torn = False
        """True when the last update failed after changing some weights (and none since)."""
        self.weight_version: str | None = None
        """The label the last update that gave one finished with (None: none yet)."""
        self.last_update_bytes = 0
        self.last_update_seconds = 0.0
        self.lineage = Lineage()
        """Which update the weights are (`wtransfer.receiver.lineage`)."""
        self._state = ReceiverState.NEW
        self._session: UpdateSession | None = None
        self.manifests = Manifests()
        """The last tensor list an update carried (a backend resolves each update's list
        through it: `Manifests.resolve`); checked against the target when the next update
        opens, since a trainer's next update names the same one."""
        self._joined = False
        """Whether an update call has landed in the open update (one a replaced sender's
        start opened has none)."""
        self._staged = False
        """Whether the open update was checked and post-processed (`stage_weight_update`)."""
        self._superseded = False
        """Whether the last update failed because a new sender initialized the receiver (its
        old sender's finish is then told it was replaced)."""
        self._before_start: tuple[ReceiverState, str | None] = (ReceiverState.READY, None)
        """State and failure before the open update's start (restored if it is withdrawn)."""
        self._lock = threading.RLock()
        self._last_call = time.monotonic()
        self._started = 0.0
        self._deadline = DeadlineTimer(self._expire_if_abandoned,
                                       f"wtransfer-{self.backend_name}-deadline")

    # -- state ---------------------------------------------------------------------------

    @property
    def state(self) -> ReceiverState:
        """Where the receiver is in its lifecycle (see the module docstring)."""
        return self._state

    @property
    def update_bytes(self) -> int:
        """Bytes the open update has received so far (0 when none is open)."""
        session = self._session
        return session.bytes_received if session is not None else 0

    def _require(self, *states: ReceiverState, action: str) -> None:
        if self._state not in states:
            hint = _HINTS[self._state].format(failure=self.failure)
            kind = NotInitializedError if self._state is ReceiverState.NEW else LifecycleError
            raise kind(f"{self.backend_name}: cannot {action} in state "
                       f"'{self._state.value}': {hint}")

    def _fail(self, reason: str, *, finishing: bool = False, channel_busy: bool = True) -> None:
        """Fail the open update: stop the backend writing, roll back if enabled, record why.
        A staging target's live weights change only in its finish (`finishing`); an update
        refused while its channel is idle (`channel_busy` False: before any byte moved, or after
        every byte arrived) leaves the backend as it is."""
        self._deadline.disarm()
        self.lineage.forget()
        if channel_busy:
            with contextlib.suppress(Exception):  # teardown must not mask the original failure
                self._abort()
        session, self._session = self._session, None
        if session is not None:
            try:
                self.target.abort()
            except Exception:
                log.exception("%s: the target's abort failed", self.backend_name)
        touched = bool(session and session.touched) and (finishing or not self.target.stages)
        if session is not None and touched and self.rollback:
            try:
                restored = session.rollback()
                reason += f"; rolled back {restored} tensor(s) to the last good weights"
            except Exception as exc:  # the weights stay torn, and say so
                log.exception("%s: rollback failed", self.backend_name)
                reason += f"; rollback failed ({type(exc).__name__}: {exc})"
        self.failure = reason
        self.failures += 1
        self.torn = touched and bool(session and session.touched)  # unless rolled back
        self._state = ReceiverState.FAILED

    def fail_update(self, reason: str) -> None:
        """Fail the open update from outside (it failed on another worker of the same
        engine): as any failure, rolled back where enabled; nothing when none is open."""
        with self._lock:
            if self._state is ReceiverState.UPDATING:
                self._fail(reason)

    def _expire_if_abandoned(self) -> None:
        """The deadline timer's action: fail an update whose sender is gone or has been silent for
        timeout_s."""
        with self._lock:
            if self._state is not ReceiverState.UPDATING or self.init_info is None:
                return
            gone = self._sender_gone()
            idle = time.monotonic() - self._last_call
            if gone is not None:
                self._fail(f"update abandoned after {idle:.1f}s without a call: {gone}")
            elif idle >= self.init_info.timeout_s:
                self._fail(f"update abandoned: no call from the sender for {idle:.1f}s "
                           f"(timeout_s={self.init_info.timeout_s})")
            else:
                self._deadline.arm(_next_check(self))

    # -- public template methods ---------------------------------------------------------

    def init_transfer_engine(self, init_info: InitT | Mapping[str, Any]) -> None:
        """Parse and apply a new sender's init info (staging handles, wire parameters). An update
        still open (its sender died or gave up) is failed first, rolled back where enabled."""
        with _CallGuard(self):
            self._require(ReceiverState.NEW, ReceiverState.READY, ReceiverState.FAILED,
                          ReceiverState.UPDATING, action="init the transfer engine")
            _refuse_other_backend(self.backend_name, init_info)
            info: InitT = parse_record(self.init_info_cls, init_info,
                                       where=f"{self.backend_name} init info")
            if self._state is ReceiverState.UPDATING:
                self._fail("update superseded: a new sender initialized this receiver")
                self._superseded = True
            self._programs.clear()  # (views of the staging a new sender replaces)
            if self.init_info is not None:
                self._shutdown()
                self.init_info = None
            self.lineage.forget()  # a new sender: its first update is full
            self._init(info)
            self.init_info = info
            if self._state is ReceiverState.NEW:
                self._state = ReceiverState.READY

    def start_weight_update(self) -> None:
        """Open an update; weights change only between this and `finish_weight_update`."""
        with _CallGuard(self):
            self._require(ReceiverState.READY, ReceiverState.FAILED,
                          action="start a weight update")
            self._session = UpdateSession(
                self.target, self.device,
                rollback=(self._rollback_store if self.rollback and not self.target.stages
                          else None),
                check_finite=not (self.init_info is not None
                                  and self.init_info.allow_non_finite),
                programs=self._programs)
            if self.manifests.last is not None:
                self._session.precheck(self.manifests.last.metas)
            self._start()
            self._before_start = (self._state, self.failure)
            self._superseded = False
            self._staged = False
            self.lineage.start()
            self._joined = False
            self.failure = None
            self._state = ReceiverState.UPDATING
            self._started = time.monotonic()

    def update_weights(self, update_info: UpdateT | Mapping[str, Any]) -> None:
        """Receive one part of the update (a backend may be called any number of times)."""
        with _CallGuard(self):
            self._refuse_replaced(update_info)
            self._require(ReceiverState.UPDATING, action="update weights")
            assert self._session is not None
            header = False  # a failure of the strategy's header call: no data moved yet
            try:
                info: UpdateT = parse_record(self.update_info_cls, update_info,
                                             where=f"{self.backend_name} update info")
                self._joined = True
                if info.abort is not None:
                    raise PeerError(f"sender aborted the update: {info.abort}")
                header = self.lineage.carries_header(info)
                if header:
                    self.lineage.open(info, self._session, self.target, self.manifests.last)
                    return
                self._receive(info, self._session)
            except BaseException as exc:
                self._fail(f"{type(exc).__name__}: {exc}", channel_busy=not header)
                raise

    def _refuse_replaced(self, update_info: Any) -> None:
        """`LifecycleError` for an update call of a sender that a newer init replaced, before
        anything else happens: its bytes would be read from staging that now belongs to
        another sender. An open update that only its own start opened (no call landed in it)
        is withdrawn with it; any other open update is left alone."""
        if self.init_info is None or self._state is ReceiverState.CLOSED:
            return
        sender = (update_info.get("sender_id") if isinstance(update_info, Mapping)
                  else getattr(update_info, "sender_id", None))
        if not isinstance(sender, str) or sender == self.init_info.sender_id:
            return
        aborting = (update_info.get("abort") if isinstance(update_info, Mapping)
                    else getattr(update_info, "abort", None)) is not None
        if self._state is ReceiverState.UPDATING and not self._joined and not aborting:
            # (a replaced sender's late abort never withdraws the current sender's update)
            self._session = None  # nothing of it arrived: no backend or target state to undo
            self._state, self.failure = self._before_start
        raise SenderReplacedError(f"{self.backend_name}: this sender was replaced by a newer "
                             "trainer_init (the receiver now serves another sender); create a "
                             "new sender with trainer_init")

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """Check the update is complete, run backend and target post-processing, close it;
        label the weights `weight_version` (a bad label is refused before anything closes)."""
        with _CallGuard(self):
            if self._state is ReceiverState.FAILED and self._superseded:
                raise SenderReplacedError(f"{self.backend_name}: this sender was replaced by a "
                                          "newer trainer_init while its update was open (the "
                                          "update was dropped); create a new sender with "
                                          "trainer_init")
            self._require(ReceiverState.UPDATING, action="finish a weight update")
            if weight_version is not None:
                check_version(weight_version)
            session = self._session
            assert session is not None
            self._stage(session)
            try:
                self.target.finish()
            except BaseException as exc:
                self._fail(f"{type(exc).__name__}: {exc}", finishing=True)
                raise
            if weight_version is not None:
                self.weight_version = weight_version
            self.lineage.landed()
            self.last_update_bytes = session.bytes_received
            self.last_update_seconds = time.monotonic() - self._started
            self._session = None
            self.torn = False
            self._state = ReceiverState.READY

    def _stage(self, session: UpdateSession) -> None:
        """The open update's checks and the backend's post-processing, once: every byte
        arrived, no value is NaN or infinite; a failure fails the update."""
        if self._staged:
            return
        try:
            session.finish()
        except BaseException as exc:  # every byte arrived: the channel is idle
            self._fail(f"{type(exc).__name__}: {exc}", channel_busy=False)
            raise
        try:
            self._finish()
        except BaseException as exc:
            self._fail(f"{type(exc).__name__}: {exc}")
            raise
        self._staged = True

    def stage_weight_update(self) -> None:
        """Everything `finish_weight_update` does before the update goes live: it is checked
        complete and sound and post-processed, and stays open. A fleet stages every instance
        before any commits (`finish_weight_update`) or, if one failed, discards it on every
        other (`discard_weight_update`)."""
        with _CallGuard(self):
            self._require(ReceiverState.UPDATING, action="stage a weight update")
            assert self._session is not None
            self._stage(self._session)

    def discard_weight_update(self, reason: str) -> None:
        """Fail the open update on purpose (another instance of the fleet failed it): a
        staging target drops what it staged, an in-place one rolls back where enabled, as
        for any failed update; nothing when no update is open."""
        with _CallGuard(self):
            if self._state is ReceiverState.UPDATING:
                self._fail(f"discarded: {reason}", channel_busy=False)

    def shutdown(self) -> None:
        """Release every resource (staging buffers, groups); idempotent."""
        self._deadline.close()
        with self._lock:
            if self._state is ReceiverState.CLOSED:
                return
            self._programs.clear()  # (views of the staging, before it is unmapped)
            if self.init_info is not None:
                self._shutdown()
            self._close()
            self._session = None
            self._rollback_store = {}
            self._state = ReceiverState.CLOSED

    # -- backend hooks -------------------------------------------------------------------

    @abstractmethod
    def _init(self, info: InitT) -> None:
        """Open staging buffers / groups described by `info`."""

    def _start(self) -> None:
        """Per-update preparation; optional."""

    @abstractmethod
    def _receive(self, info: UpdateT, session: UpdateSession) -> None:
        """Receive the buckets `info` describes and hand them to `session.consume`."""

    def _finish(self) -> None:
        """Backend post-processing after all buckets arrived; optional."""

    def _abort(self) -> None:
        """Drop per-update state after a failure; optional."""

    def _sender_gone(self) -> str | None:
        """Why the sender is known to be gone (its connection closed), else None; asked every
        `sender_check_s` while an open update waits for its next call, from the deadline timer's
        thread under the engine's lock (so it must answer at once). Optional."""
        return None

    @abstractmethod
    def _shutdown(self) -> None:
        """Release what `_init` acquired."""

    def _close(self) -> None:
        """Release what outlives one sender (kept for the next `_init`); called once, by
        `shutdown`, after `_shutdown`. Optional."""


class _CallGuard:
    """Holds the engine's lock during a public call; while an update stays open afterwards,
    arms the deadline timer for the sender's next call."""

    def __init__(self, engine: WeightTransferEngine[Any, Any]) -> None:
        self.engine = engine

    def __enter__(self) -> None:
        self.engine._lock.acquire()
        self.engine._deadline.disarm()

    def __exit__(self, *exc: object) -> None:
        engine = self.engine
        engine._last_call = time.monotonic()
        if engine._state is ReceiverState.UPDATING and engine.init_info is not None:
            engine._deadline.arm(_next_check(engine))
        engine._lock.release()


def _next_check(engine: WeightTransferEngine[Any, Any]) -> float:
    """When the deadline timer should look at `engine`'s open update next: its sender's
    deadline, or sooner where the backend checks on the sender (`sender_check_s`)."""
    assert engine.init_info is not None
    deadline = engine._last_call + engine.init_info.timeout_s
    if engine.capabilities.sender_check_s is None:
        return deadline
    return min(deadline, time.monotonic() + engine.capabilities.sender_check_s)


def _refuse_other_backend(backend_name: str, init_info: Any) -> None:
    """`ConfigError` for an init info a sender of another backend made (named by its
    `backend` field), saying which side to change."""
    sent = (init_info.get("backend") if isinstance(init_info, Mapping)
            else getattr(init_info, "backend", None))
    if isinstance(sent, str) and sent != backend_name:
        raise ConfigError(f"this engine receives through {backend_name!r}, but the "
                          f"trainer sent a {sent!r} init info: use the {backend_name} "
                          f"trainer init info, or start the engine with the {sent!r} "
                          "backend (weight_transfer_backend)")
