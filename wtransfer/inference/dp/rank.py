"""One data-parallel rank: a process driving one `Replica` in lockstep waves with the other
ranks.

Run by the front end as ``python -m wtransfer.inference.dp.rank`` (one process per rank).

Waves. While any rank has work, every rank steps, and every step ends in an all-reduce (the
collective an expert-parallel layer needs each step); a rank without work runs a dummy step,
which is only that all-reduce. Every `dp_sync_interval` steps the ranks also all-reduce their
state (busy, pause requested, pause ready) and decide together: keep stepping, end the wave
(nobody busy, no pause requested), or enter the global pause. Waves are numbered and every rank
ends wave w at the same step, so all agree on the number: an idle rank that gets work starts the
wave it is at and tells the front end, which relays a wake-up for that number to every rank; a
rank already in that wave, or past it, ignores the wake-up.

Two-phase pause. Phase 1 (local): the pause command changes this rank's scheduler at once
(abort ends requests, keep freezes them, wait lets running ones finish), but the rank keeps
joining the wave's collectives, so no rank is ever left waiting inside one. A local pause counts
as work: it starts a wave if none runs, so the ranks can meet and agree. Phase 2 (global): when a
state sync shows every rank paused and drained, all ranks leave the wave together, reply to the
pause, and ignore wake-ups until resume. Resume from the global pause is itself a collective
(a barrier that carries each rank's verdict): either every rank resumes or none does.
Weight updates need the global pause, because a rank blocked in a transfer cannot join a wave.

Messages (plain data, `wtransfer.wire`). Front end to rank: ``{"op", "id", "args"}`` where op
is one of `COMMANDS` (run by name on this rank's `Replica`; "pause" and "resume" are this
class's own, two-phase versions), "wake" or "shutdown". Rank to front end: ``{"kind":
"reply", "id", "ok": true, "result"}`` or a failed reply (``"kind"``, ``"id"`` and the fields
of `wtransfer.errors.error_reply`), ``{"kind": "outputs", "outputs": [RequestOutput.to_wire
...]}``, ``{"kind": "wave", "wave"}``, ``{"kind": "ready"}``, and ``{"kind": "fatal"}`` with
the `error_reply` fields.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import torch

from wtransfer.errors import LifecycleError, PeerError, error_reply, ok_reply
from wtransfer.inference.commands import run_command
from wtransfer.inference.config import EngineConfig
from wtransfer.inference.dp.collective import RankGroup
from wtransfer.inference.dp.output_stream import RankOutputs
from wtransfer.inference.outputs import OutputSnapshot, RequestOutput
from wtransfer.inference.steps.scheduler import PauseState
from wtransfer.inference.updates.replica import Replica
from wtransfer.inference.updates.transfer_lane import TransferLane
from wtransfer.records import PauseMode
from wtransfer.transport.channel import Channel, receive_record, send_record
from wtransfer.transport.stacks import print_stacks_on_sigusr1
from wtransfer.wire import parse_record

log = logging.getLogger("wtransfer.dp")
_IDLE_POLL_MS = 200
_LANE_POLL_MS = 1
"""How often an idle rank looks for its lane's results while a lane call runs."""


_RANK_COMMANDS = frozenset({"pause", "resume", "start_weight_update", "stats"})
"""Commands a rank answers itself (its two-phase pause, barrier resume, the rule that an
in-place update needs the global pause, its lockstep counters); the rest are its replica's."""


class DPRank:
    """Rank `rank` of `config.data_parallel_size`: drives one `Replica` (`replica`), executing
    the front end's commands between lockstep steps. `group()` forms the ranks' group once
    this rank's model is loaded."""

    def __init__(self, config: EngineConfig, rank: int, socket: Channel,
                 group: Callable[[], RankGroup]) -> None:
        self._outbox: list[dict[str, Any]] = []
        self._outputs = RankOutputs()
        """What the front end holds of each live request's output (new tokens travel)."""
        self.socket = socket
        self.config = config
        self.replica = Replica(config, self._collect,
                               worker_index=rank * config.tensor_parallel_size)
        """The model, KV cache, scheduler and receiver this rank steps."""
        self.group = group()
        self._lane = (TransferLane(self.replica, self._run, self._at_step_boundary,
                                   config.call_timeout_s)
                      if self.replica.staging is not None else None)
        """Where this rank's weight-transfer calls run when it stages (off its main loop)."""
        self._boundary: deque[tuple[Callable[[], Any], Future[Any]]] = deque()
        """Functions the lane hands to the main loop, run between two steps (a commit)."""
        self._lane_done: deque[tuple[int, Future[Any]]] = deque()
        """Lane calls that finished, for the main loop to answer (one thread uses the
        socket)."""
        self._lane_busy = 0
        self.wave = 0
        self.in_wave = False
        self.global_paused = False
        self.wave_steps = 0
        self.dummy_steps = 0
        self.waves_started = 0
        self._pause_waiters: list[Future[None]] = []
        self._stopping = False
        self._parent = os.getppid()

    # -- messages --------------------------------------------------------------------------

    def _collect(self, output: RequestOutput | OutputSnapshot) -> None:
        self._outbox.append(self._outputs.entry(output))

    def _send(self, message: dict[str, Any]) -> None:
        send_record(self.socket, message)

    def _flush(self) -> None:
        if self._outbox:
            outputs, self._outbox = self._outbox, []
            self._send({"kind": "outputs", "outputs": outputs})

    def _reply(self, call_id: int, result: Any = None, error: BaseException | None = None
               ) -> None:
        self._flush()  # outputs a call produced (aborts) reach the front end before its reply
        if error is None:
            self._send({"kind": "reply", "id": call_id, **ok_reply(result)})
        else:
            self._send({"kind": "reply", "id": call_id, **error_reply(error)})

    def _drain_commands(self, timeout_ms: int) -> None:
        if not self.socket.wait(timeout_ms):
            return
        while (received := receive_record(self.socket, block=False)) is not None:
            self._handle(received[1])

    def _handle(self, message: dict[str, Any]) -> None:
        op, call_id, args = message["op"], int(message.get("id", -1)), message.get("args", [])
        if op == "wake":
            self._on_wake(int(args[0]))
            return
        if self._lane is not None and self._lane.takes(op):
            self._lane_busy += 1
            self._lane.submit(op, args).add_done_callback(
                lambda done: self._lane_done.append((call_id, done)))
            return
        try:
            if op == "shutdown":
                result: Any = self.replica.abort(None)
                self._stopping = True
            else:
                result = self._run(op, args)
        except Exception as exc:
            self._reply(call_id, error=exc)
            return
        if isinstance(result, Future):  # a pause: answer once it holds (phase 2)
            result.add_done_callback(lambda f: self._reply(call_id, error=f.exception()))
        else:
            self._reply(call_id, result)

    def _run(self, command: str, args: Sequence[Any]) -> Any:
        """Run one engine command: this rank's own (`_RANK_COMMANDS`), else its replica's."""
        self.replica.settle_failure()  # a rank's watchdog may have failed an update just now
        return run_command(self if command in _RANK_COMMANDS else self.replica, command, args)

    def _at_step_boundary(self, fn: Callable[[], Any]) -> Future[Any]:
        """For the lane: run `fn` on the main loop between two steps."""
        future: Future[Any] = Future()
        self._boundary.append((fn, future))
        return future

    def _serve_lane(self) -> None:
        """Run what the lane handed over, and answer its finished calls (main loop)."""
        while self._boundary:
            fn, future = self._boundary.popleft()
            if not future.set_running_or_notify_cancel():
                continue  # (its caller gave up waiting: it must not run any more)
            try:
                future.set_result(fn())
            except Exception as exc:
                future.set_exception(exc)
        while self._lane_done:
            call_id, done = self._lane_done.popleft()
            self._lane_busy -= 1
            error = done.exception()
            self._reply(call_id, None if error is not None else done.result(), error)

    # -- waves -----------------------------------------------------------------------------

    def _pause_requested(self) -> bool:
        return self.replica.scheduler.state is not PauseState.UNPAUSED and not self.global_paused

    def _wants_wave(self) -> bool:
        return not self.global_paused and (self.replica.can_step() or self._pause_requested())

    def _begin_wave(self, announce: bool) -> None:
        self.in_wave, self.wave_steps = True, 0
        self.waves_started += 1
        if announce:
            self._send({"kind": "wave", "wave": self.wave})

    def _end_wave(self) -> None:
        self.in_wave, self.wave_steps = False, 0
        self.wave += 1

    def _on_wake(self, wave: int) -> None:
        if not self.global_paused and not self.in_wave and wave == self.wave:
            self._begin_wave(announce=False)

    def _wave_step(self) -> None:
        advanced = self.replica.step() if self.replica.can_step() else 0
        self.replica.resolve_drains()
        self._flush()
        if not advanced:
            self.dummy_steps += 1
        self.group.all_reduce([advanced])
        self.wave_steps += 1
        if self.wave_steps % self.config.dp_sync_interval == 0:
            self._sync()

    def _sync(self) -> None:
        busy = self.replica.can_step()
        requested = self._pause_requested()
        ready = requested and not busy
        n_busy, n_requested, n_ready = self.group.all_reduce([busy, requested, ready])
        if os.getppid() != self._parent:
            raise PeerError("the front end died")  # the peers' next collective fails too
        if n_ready == self.group.size:
            self._end_wave()
            self.global_paused = True
            waiters, self._pause_waiters = self._pause_waiters, []
            for waiter in waiters:
                waiter.set_result(None)
        elif n_busy == 0 and n_requested == 0:
            self._end_wave()

    # -- pause and resume ------------------------------------------------------------------

    def pause(self, mode: PauseMode, clear_cache: bool) -> Future[None]:
        """Phase 1 at once; the future completes in phase 2 (every rank paused and drained)."""
        held: Future[None] = Future()
        if self.global_paused:
            if mode != "wait":  # no rank steps in the global pause, so a wait-mode pause
                self.replica.pause(mode, clear_cache)  # could never drain kept requests: they stay
            elif clear_cache:
                self.replica.blocks.reset_prefix_cache()
            held.set_result(None)
            return held
        self.replica.pause(mode, clear_cache)
        self._pause_waiters.append(held)
        return held

    def resume(self) -> None:
        """Leave the pause; from the global pause, all ranks resume together or none does."""
        if not self.global_paused:
            self.replica.resume()
            waiters, self._pause_waiters = self._pause_waiters, []
            for waiter in waiters:
                waiter.set_exception(LifecycleError(
                    "resumed before every data-parallel rank had paused"))
            return
        refusal = self.replica.resume_refusal()
        has_requests = bool(self.replica.scheduler.running or self.replica.scheduler.waiting)
        n_ok, n_busy = self.group.all_reduce([refusal is None, has_requests])  # the barrier
        if n_ok < self.group.size:
            raise LifecycleError(refusal or f"{self.group.size - n_ok} other rank(s) refused to "
                                            "resume (an update is open or failed there)")
        self.replica.scheduler.state = PauseState.UNPAUSED
        self.global_paused = False
        if n_busy:
            self._begin_wave(announce=False)  # every rank saw n_busy: all start this wave

    def start_weight_update(self) -> None:
        """Open an update; with data parallelism only in the global pause."""
        if not self.global_paused and self.replica.staging is None:
            raise LifecycleError("with data_parallel_size > 1, call pause_generation(...) "
                                 "before start_weight_update: ranks step in lockstep, and one "
                                 "busy receiving weights would stall the others (or serve "
                                 "with update_staging='swap': each rank stages beside its "
                                 "steps)")
        self.replica.start_weight_update()

    def stats(self) -> dict[str, Any]:
        """Counters, plus this rank's lockstep state."""
        rank = self.replica.worker_index // self.config.tensor_parallel_size
        return {**self.replica.stats(), "rank": rank,
                "device": str(self.replica.runner.device),
                "wave": self.wave,
                "in_wave": self.in_wave, "global_paused": self.global_paused,
                "dummy_steps": self.dummy_steps, "waves_started": self.waves_started}

    def close(self) -> None:
        """Release the replica (its receiver, workers and device memory)."""
        self.replica.close()

    # -- main loop -------------------------------------------------------------------------

    def run(self) -> None:
        """Serve until the front end says shutdown (or goes away)."""
        self._send({"kind": "ready"})
        while not self._stopping:
            self.replica.settle_failure()
            self._serve_lane()
            if self.in_wave:
                self._drain_commands(0)
                if not self._stopping:
                    self._wave_step()
            elif self._wants_wave():
                self._begin_wave(announce=True)
            else:
                self._drain_commands(_LANE_POLL_MS if self._lane_busy else _IDLE_POLL_MS)
                self.replica.keep_workers_alive()
                if os.getppid() != self._parent:
                    return  # the front end died; nobody is left to serve
        self._flush()
        if self._lane is not None:
            self._lane.shutdown()


def place(config: EngineConfig, rank: int) -> EngineConfig:
    """`device="cuda"` puts rank r on GPU r (modulo the GPUs present); an explicit device
    (`cpu`, `cuda:N`) is used by every rank as given."""
    if config.device == "cuda" and torch.cuda.is_available():
        return dataclasses.replace(config, device=f"cuda:{rank % torch.cuda.device_count()}")
    return config


def connect(frontend: str, rank: int) -> Channel:
    """This rank's channel to the front end (its identity names the rank)."""
    return Channel.connect(frontend, identity=f"rank-{rank}", linger_ms=1000)


def main(argv: list[str] | None = None) -> int:
    """Entry point of a rank process."""
    print_stacks_on_sigusr1()
    parser = argparse.ArgumentParser(description="one data-parallel engine rank")
    parser.add_argument("--config", required=True, help="EngineConfig as JSON")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--frontend", required=True, help="front end's ZMQ address")
    parser.add_argument("--store", required=True, help="host:port of the rendezvous store")
    parser.add_argument("--session", required=True)
    args = parser.parse_args(argv)
    socket = connect(args.frontend, args.rank)
    node: DPRank | None = None
    try:
        config = place(parse_record(EngineConfig, json.loads(args.config), where="--config"),
                       args.rank)
        size = config.data_parallel_size
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
        host, port = args.store.rsplit(":", 1)
        node = DPRank(config, args.rank, socket,
                      lambda: RankGroup(host, int(port), args.session, args.rank, size,
                                        config.step_timeout_s))
        node.run()
    except Exception as exc:
        send_record(socket, {"kind": "fatal", **error_reply(exc)})
        log.error("data-parallel rank %d failed: %s: %s", args.rank, type(exc).__name__, exc)
        return 1
    finally:
        if node is not None:
            node.close()
        socket.close(linger_ms=1000)
    return 0


if __name__ == "__main__":
    sys.exit(main())
