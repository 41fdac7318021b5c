"""One update's control calls: start, update call(s), finish, issued back to back.

A sender's update is a short sequence of calls on its client. Waiting for each reply before
sending the next costs a round trip per call; the engine runs them in order anyway, so they
go through a `wtransfer.protocol.CallQueue` without waiting, each to run only if the one
before it succeeded, and are settled in order: the first failure (the cause) is the one
reported, not the refusals that follow it. A lone sender holds its start back until its first
update call (or its finish) joins it, so a client that batches (`HTTPClient`) carries them in
one request: a zero-copy update, or one bucket, is start, update and finish in one round trip.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch

from wtransfer.errors import TransferTimeout
from wtransfer.packing import Bucket, bucket_checksum
from wtransfer.protocol import CallQueue, PausingClient, PendingCall, StagingClient
from wtransfer.records import PauseMode
from wtransfer.transport.window import CallChannel, SendChannel


@dataclass(frozen=True)
class Role:
    """This rank's part in an update's control calls (the lead issues start and finish)."""

    lead: bool
    senders: int
    """How many trainer ranks send (more than one: finish waits for every rank's verdict)."""
    pause: tuple[PausingClient, PauseMode] | None = None
    """The lead's client and the pause wanted around the finish (None: no pause)."""
    staging: StagingClient | None = None
    """The lead's client when its engine stages updates (finish waits for the staging)."""
    spin_from: float | None = None
    """From when replies are polled for without sleeping (`protocol.spin_start`)."""


class UpdateCalls:
    """One update's calls through a `CallQueue`: start, update call(s), finish, issued without
    waiting and settled in order. A call's failure usually makes the engine refuse the calls
    after it (wrong state), so the first failure in order is the one reported."""

    def __init__(self, queue: CallQueue, timeout_s: float, weight_version: str | None,
                 sender_id: str | None = None, role: Role | None = None) -> None:
        self.queue = queue
        self.timeout_s = timeout_s
        self.role = role if role is not None else Role(lead=True, senders=1)
        self.weight_version = weight_version
        self.sender_id = sender_id
        """Stamped on every update call: receivers refuse the calls of a replaced sender."""
        self._calls: list[PendingCall] = []
        self._methods: list[str] = []
        self._settled = 0
        self.refused: str | None = None
        """The method whose failure `check` or `settle` raised (None: none did)."""
        self.finish_issued = False
        self._hold = contextlib.ExitStack()
        """Holds the queue's calls back from a lone sender's start until its first update
        call joins it (`release`)."""

    def submit(self, method: str, **args: Any) -> PendingCall:
        """Issue a call that the engine runs only if the call before it succeeded (an update
        must not land in an update that was never opened, say, by someone else)."""
        call = self.queue.submit(method, after=self._calls[-1] if self._calls else None,
                                 **args)
        self._calls.append(call)
        self._methods.append(method)
        return call

    def start(self) -> None:
        """Issue start (a lone sender's waits for the calls that follow it, where its client
        batches them: `release`)."""
        if self.role.lead and self.role.senders == 1:
            self._hold.enter_context(self.queue.held())
        self.submit("start_weight_update")

    def release(self) -> None:
        """Let the held calls go: before anything waits for them, once a bucket's call is
        issued with more to follow, and before data moves on a backend's own channel."""
        self._hold.close()

    def update(self, update_info: dict[str, Any]) -> PendingCall:
        """Issue one update call (stamped with the sender's identity)."""
        return self.submit("update_weights", update_info=self._stamped(update_info))

    def _stamped(self, update_info: dict[str, Any]) -> dict[str, Any]:
        if self.sender_id is None:
            return update_info
        return {**update_info, "sender_id": self.sender_id}

    def abort(self, reason: str, grace_s: float = 5.0) -> None:
        """Tell the engine the update failed on this side, so it fails it now instead of at
        its deadline; runs only if this update's start succeeded. Waits (up to `grace_s`) for
        the engine to take it only when every earlier call is answered: behind a call still
        running (an update blocked in its receive loop) it would wait that call's deadline."""
        answered = all(call.done() for call in self._calls)
        self.drop()  # what came before is answered or moot: the update failed
        call = self.queue.submit("update_weights", after=self._calls[0] if self._calls
                                 else None, update_info=self._stamped({"abort": reason}))
        self._calls.append(call)
        self._methods.append("update_weights")
        if answered:
            self._calls[-1].result(grace_s)
        self._settled = len(self._calls)

    def finish(self) -> None:
        """Issue finish. Issued right behind the update call(s), it waits at the engine,
        which runs it as soon as they succeed: finishing costs no round trip of its own."""
        self.submit("finish_weight_update", weight_version=self.weight_version)
        self.finish_issued = True
        self.release()

    def check(self) -> None:
        """Raise the first failure among the replies already in (never blocks): a refused
        update is seen while the data is still moving."""
        while self._settled < len(self._calls):
            call = self._calls[self._settled]
            if not call.done():
                return
            self._result(0)

    def settle(self, spin_from: float | None = None) -> None:
        """Wait for every issued call in order; raise the first failure (and stop waiting for
        the rest). From `spin_from` on, replies are polled for without sleeping
        (`PendingCall.result`)."""
        self.release()
        try:
            while self._settled < len(self._calls):
                self._result(self.timeout_s, spin_from)
        except BaseException:
            self.drop()
            raise

    def _result(self, timeout_s: float, spin_from: float | None = None) -> None:
        """Settle the next call in order, noting its method in `refused` if it failed."""
        call = self._calls[self._settled]
        try:
            if spin_from is None:
                call.result(timeout_s)
            else:
                call.result(timeout_s, spin_from=spin_from)
        except BaseException:
            if call.done():
                self.refused = self._methods[self._settled]
            raise
        self._settled += 1

    @property
    def refused_at_finish(self) -> bool:
        """Whether the engine took every update call and refused only the finish (the data
        moved whole: the channel is intact, as after a success)."""
        return self.refused == "finish_weight_update"

    def cause(self, local: BaseException, grace_s: float = 5.0) -> BaseException:
        """The engine's own error for a failure seen here as `local` (the data channel breaks
        moments before the refusal's reply arrives, and the reply is the useful message), if
        it comes within `grace_s`; else `local`."""
        self.release()
        try:
            while self._settled < len(self._calls):
                call = self._calls[self._settled]
                try:
                    call.result(grace_s)
                except BaseException as exc:
                    return exc if call.done() else local  # not done: no reply in the grace
                self._settled += 1
        finally:
            self.drop()
        return local

    def drop(self) -> None:
        """Stop waiting for every call not yet settled (calls still held are never sent)."""
        for call in self._calls[self._settled:]:
            with contextlib.suppress(Exception):
                call.cancel()
        self._settled = len(self._calls)
        self.release()

    def settle_first(self) -> None:
        """The lead waits for the answer to an update's first call (before any byte moves,
        so a receiver that cannot take the update refuses it with nothing written)."""
        if not self.role.lead:
            return
        try:
            self.settle()
        except BaseException as exc:  # receivers that took it: fail it now
            self.abort_for(exc)
            raise

    def abort_for(self, exc: BaseException) -> None:
        """Tell the receivers the update failed here (`exc`), so they fail it now instead of
        at their deadline; not after a timeout (a receiver that does not answer would not
        answer this either)."""
        if isinstance(exc, TransferTimeout):
            return
        with contextlib.suppress(Exception):  # a failed receiver's own deadline covers it
            self.abort(f"{type(exc).__name__}: {exc}"[:1000])

    def finish_behind_updates(self) -> None:
        """Once every update call of a lone sender is issued, its finish goes right behind
        them; with several senders, or a pause around the finish, it waits for every rank's
        verdict instead, as it does for an engine that would hold its steps while a finish
        waits for data still on its way (a `StagingClient`'s)."""
        role = self.role
        if role.lead and role.senders == 1 and role.pause is None and role.staging is None:
            self.finish()

    def close(self) -> None:
        """The lead waits for every reply; with several senders, or a pause around the
        finish, it issues finish now that every rank's part succeeded (a lone sender issued
        it behind its update calls), pausing the engine around it when asked."""
        role = self.role
        if not role.lead:
            return
        if role.staging is not None:
            self.settle()
            role.staging.wait_staged(self.timeout_s)  # the finish: the commit only
        if role.pause is None:
            if not self.finish_issued:
                self.finish()
            self.settle(role.spin_from)
            return
        self.settle()  # every byte is in: only the finish runs paused
        client, mode = role.pause
        client.pause(mode=mode, clear_cache=True)
        try:
            self.finish()
            self.settle()
        finally:
            client.resume()

    def through(self, channel: CallChannel, checksum: bool,
                units: int) -> SendChannel[PendingCall]:
        """`channel` as the send loop sees it: posting a bucket issues its update call (with
        its bytes' checksum when asked), and the slot is free once that call is answered
        (within the transfer's deadline). Every call but the last of `units` goes at once;
        the last may wait for the finish that follows it."""
        posted = 0

        def post(unit: list[Bucket], slot: int, data: list[torch.Tensor]) -> PendingCall:
            nonlocal posted
            digest = bucket_checksum(data[0]) if checksum else None
            call = self.update(channel.describe(unit[0], slot, data[0], digest))
            posted += 1
            if posted < units:
                self.release()
            return call

        def wait(call: PendingCall, _check: Any) -> None:
            self.release()
            call.result(self.timeout_s)

        return SendChannel(slots=channel.slots, stage=channel.stage, post=post, wait=wait)
