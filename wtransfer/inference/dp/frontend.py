"""The data-parallel front end: N rank processes behind one `AsyncEngine`.

`DataParallelCore` serves the same commands as `EngineCore` (`submit(command, ...)`, one of
`COMMANDS`). It starts the rank processes, hosts their rendezvous store, and owns one ZeroMQ
ROUTER socket on an I/O thread: commands go out through it, and replies, outputs, wave
announcements and fatal errors come back through it (the messages are listed in `rank.py`).
Requests go to the rank with the fewest outstanding requests and aborts to the rank holding
the request; every other command goes to every rank and completes when every rank answered,
its results combined by `_COMBINE` (the ranks must agree on versions and weights).

A rank that dies breaks the engine: pending calls fail with `RemoteEngineDeadError` (a
`PeerError`), every live request ends with finish_reason "error" naming the rank, the other
ranks are stopped, and later calls fail at once. A failure inside one rank's step ends only
that step's requests (`Replica.step`).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import Future
from typing import Any, TypeVar

from wtransfer import wire
from wtransfer.errors import (
    ConfigError,
    IntegrityError,
    LifecycleError,
    PeerError,
    RemoteEngineDeadError,
    TransferTimeout,
    WTransferError,
    from_reply,
    reply_result,
)
from wtransfer.inference.commands import Emit, check_command, check_engine_call
from wtransfer.inference.config import EngineConfig
from wtransfer.inference.dp.collective import host_store
from wtransfer.inference.dp.output_stream import FrontEndOutputs
from wtransfer.inference.params import SamplingParams
from wtransfer.records import check_pause_mode
from wtransfer.transport.channel import Channel, ChannelClosedError, wait_any
from wtransfer.wire import parse_record, record_to_wire

log = logging.getLogger("wtransfer.dp")
T = TypeVar("T")
U = TypeVar("U")
_POLL_MS = 100
_PEER_EXIT_GRACE_S = 2.0  # how long a survivor's "a rank died" waits for the dead one's exit
_HOST = "127.0.0.1"


def _done(value: Any) -> Future[Any]:
    future: Future[Any] = Future()
    future.set_result(value)
    return future


def _failed(exc: BaseException) -> Future[Any]:
    future: Future[Any] = Future()
    future.set_exception(exc)
    return future


def _then(future: Future[T], fn: Callable[[T], U]) -> Future[U]:
    """A future of `fn(result)`; failures pass through. Running from the start: the ranks
    run what was sent whatever its caller does, so it cannot be cancelled."""
    out: Future[U] = Future()
    out.set_running_or_notify_cancel()

    def chain(f: Future[T]) -> None:
        exc = f.exception()
        if exc is not None:
            out.set_exception(exc)
            return
        try:
            out.set_result(fn(f.result()))
        except Exception as error:
            out.set_exception(error)

    future.add_done_callback(chain)
    return out


def _all(futures: list[Future[Any]]) -> Future[list[Any]]:
    """One future for many: the results in order, or the first failure (in rank order) once
    every future is done, so no rank's answer is still in flight when the caller moves on."""
    if not futures:
        return _done([])
    out: Future[list[Any]] = Future()
    out.set_running_or_notify_cancel()  # (sent: it cannot be cancelled, as `_then`'s)
    remaining = [len(futures)]
    lock = threading.Lock()

    def one_done(_: Future[Any]) -> None:
        with lock:
            remaining[0] -= 1
            if remaining[0]:
                return
        errors = [f.exception() for f in futures if f.exception() is not None]
        if errors:
            out.set_exception(errors[0])
        else:
            out.set_result([f.result() for f in futures])

    for future in futures:
        future.add_done_callback(one_done)
    return out


def _agree(what: str) -> Callable[[list[Any]], Any]:
    """Combine per-rank results that must be equal: the common value, else `IntegrityError`."""

    def agree(per_rank: list[Any]) -> Any:
        odd = [rank for rank, value in enumerate(per_rank) if value != per_rank[0]]
        if odd:
            raise IntegrityError(f"data-parallel ranks {odd} hold different {what} from rank 0; "
                                 "complete a weight update")
        return per_rank[0]

    return agree


def _worst_stall(per_rank: list[float | None]) -> float | None:
    """The engine's stall: the worst rank's, None while any rank's window is still open."""
    closed = [v for v in per_rank if v is not None]
    return max(closed) if len(closed) == len(per_rank) else None


def _merge_stats(per_rank: list[Any]) -> dict[str, Any]:
    total = {key: sum(s[key] for s in per_rank)
             for key in ("steps", "tokens_generated", "running", "waiting",
                         "prefix_cache_hits", "preemptions", "last_update_bytes",
                         "dummy_steps", "waves_started", "decode_graphs_built")}
    return {**total, "paused": any(s["paused"] for s in per_rank),
            "torn": any(s["torn"] for s in per_rank),
            "weight_version": per_rank[0]["weight_version"],
            "last_update_seconds": max(s["last_update_seconds"] for s in per_rank),
            "update_stall_ms": _worst_stall([s["update_stall_ms"] for s in per_rank]),
            "ranks": per_rank}


def _merge_weight_info(per_rank: list[Any]) -> dict[str, Any]:
    torn = [rank for rank, info in enumerate(per_rank) if info["torn"]]
    states = sorted({info["update_state"] for info in per_rank})
    return {"weight_version": _agree("weight versions")([i["weight_version"] for i in per_rank]),
            "update_state": states[0] if len(states) == 1 else "mixed:" + ",".join(states),
            "torn": bool(torn),
            "failure": next((per_rank[r]["failure"] for r in torn), None),
            "rollback": all(info["rollback"] for info in per_rank),
            "update_bytes": sum(info["update_bytes"] for info in per_rank),
            "update_staging": per_rank[0]["update_staging"],
            "update_stall_ms": _worst_stall([info["update_stall_ms"] for info in per_rank]),
            "update_commit_ms": max(info["update_commit_ms"] for info in per_rank),
            "previous_version": per_rank[0]["previous_version"],
            "adapters": _agree("adapters")([info["adapters"] for info in per_rank]),
            "workers": [w for info in per_rank for w in info["workers"]],
            "ranks": per_rank}


_COMBINE: dict[str, Callable[[list[Any]], Any]] = {
    "is_paused": any,
    "get_weight_version": _agree("weight versions"),
    "fingerprint": _agree("weights"),
    "weight_info": _merge_weight_info,
}
"""How the ranks' answers to a command become one; commands not listed answer None."""


class DataParallelCore:
    """Front end over `config.data_parallel_size` rank processes (see the module docstring)."""

    def __init__(self, config: EngineConfig, emit: Emit) -> None:
        self.config = config
        self.emit = emit
        self.size = config.data_parallel_size
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._calls: dict[int, tuple[int, Future[Any]]] = {}
        self._live: dict[str, tuple[int, list[int]]] = {}
        """Each unfinished request's rank and prompt."""
        self._outputs = FrontEndOutputs()
        """The front end's copy of each live request's output (ranks send new tokens)."""
        self._ready: set[int] = set()
        self._started = threading.Event()
        self._broken: str | None = None
        self._closing = False
        self.waves_relayed = 0
        self._startup_error: Exception | None = None

        self._router = Channel.serve(f"tcp://{_HOST}:*", peers_must_exist=True)
        self._outbox, self._inbox = Channel.wakeup_pair(f"wtransfer-dp-{id(self)}")
        """Calls from other threads go to the io thread, which alone uses the router."""
        self._outbox_lock = threading.Lock()
        self._store = host_store(_HOST, config.step_timeout_s)
        self._session = secrets.token_hex(6)
        self._procs = [self._spawn(rank) for rank in range(self.size)]
        self._io = threading.Thread(target=self._io_loop, name="wtransfer-dp-io", daemon=True)
        self._io.start()
        self._wait_started()

    def failure(self) -> str | None:
        """Why the engine cannot serve any more (a rank died or failed), or None."""
        return self._broken

    # -- processes -------------------------------------------------------------------------

    def _spawn(self, rank: int) -> subprocess.Popen[bytes]:
        command = [sys.executable, "-m", "wtransfer.inference.dp.rank",
                   "--config", json.dumps(record_to_wire(self.config)),
                   "--rank", str(rank),
                   "--frontend", self._router.address,
                   "--store", f"{_HOST}:{self._store.port}", "--session", self._session]
        return subprocess.Popen(command)

    def _wait_started(self) -> None:
        deadline = self.config.call_timeout_s
        if not self._started.wait(deadline):
            self._fail(f"the data-parallel ranks did not start within {deadline:g}s")
        if self._broken is not None:
            self.shutdown()
            if self._startup_error is not None:
                raise self._startup_error  # e.g. ConfigError: the model a rank could not load
            raise PeerError(f"data-parallel engine failed to start: {self._broken}")

    def _check_processes(self) -> None:
        for rank, proc in enumerate(self._procs):
            code = proc.poll()
            if code is not None and not self._closing and self._broken is None:
                if self._router.wait(50):  # its last words (a fatal message) come first
                    self._read_router()
                self._fail(f"data-parallel rank {rank} exited with code {code}")
                return

    def _dead_peer(self, survivor: int, within_s: float) -> tuple[int, int] | None:
        """The rank other than `survivor` that exited, and its exit code, waiting up to
        `within_s` for it to be reaped: a dead peer's sockets close before its exit is visible,
        so the survivor's collective can report the death first."""
        deadline = time.monotonic() + within_s
        while True:
            for rank, proc in enumerate(self._procs):
                code = proc.poll()
                if rank != survivor and code is not None:
                    return rank, code
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.01)

    def _fail(self, reason: str) -> None:
        """Break the engine: fail pending calls, end live requests with finish_reason "error",
        stop every rank; later calls fail at once (`RemoteEngineDeadError`)."""
        with self._lock:
            if self._broken is not None:
                return
            self._broken = reason
            calls, self._calls = self._calls, {}
            live, self._live = self._live, {}
        self._started.set()
        for _, future in calls.values():
            if not future.done():
                future.set_exception(RemoteEngineDeadError(reason))
        for rid, (_, prompt) in live.items():
            self.emit(self._outputs.end(rid, prompt, reason))
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()

    # -- the socket ------------------------------------------------------------------------

    def _io_loop(self) -> None:
        try:
            self._io_steps()
        except Exception as exc:  # (a message it cannot take: the engine breaks, no call hangs)
            log.exception("the data-parallel front end's socket loop failed")
            self._fail(f"the front end's socket loop failed: {type(exc).__name__}: {exc}")

    def _io_steps(self) -> None:
        next_check = 0.0
        while not self._closing:
            ready = wait_any([self._router, self._inbox], _POLL_MS)
            if self._inbox in ready:
                for frames in self._inbox.waiting():
                    self._route(frames[0], frames[1])
            if self._router in ready:
                self._read_router()
            if time.monotonic() >= next_check:  # not on every message: outputs flow per step
                self._check_processes()
                next_check = time.monotonic() + _POLL_MS / 1000

    def _read_router(self) -> None:
        for identity, payload in self._router.waiting():
            rank = int(identity.decode().rsplit("-", 1)[1])
            self._on_message(rank, wire.decode(payload))

    def _route(self, identity: bytes, payload: bytes) -> None:
        # a rank that is gone: _check_processes breaks the engine and fails the call
        with contextlib.suppress(ChannelClosedError):
            self._router.send([identity, payload])

    def _on_message(self, rank: int, message: dict[str, Any]) -> None:
        kind = message.get("kind")
        if kind == "reply":
            with self._lock:
                entry = self._calls.pop(int(message["id"]), None)
            if entry is not None and not entry[1].done():
                try:
                    entry[1].set_result(reply_result(message, f"data-parallel rank {rank}"))
                except WTransferError as exc:
                    entry[1].set_exception(exc)
        elif kind == "outputs":
            for data in message["outputs"]:
                with self._lock:
                    live = self._live.get(str(data.get("rid", data.get("request_id"))))
                output = self._outputs.take(data, live[1] if live is not None else None)
                if output.finished:
                    with self._lock:
                        self._live.pop(output.request_id, None)
                self.emit(output)
        elif kind == "wave":
            self.waves_relayed += 1
            payload = wire.encode({"op": "wake", "args": [int(message["wave"])]})
            for other in range(self.size):
                if other != rank:
                    self._route(f"rank-{other}".encode(), payload)
        elif kind == "ready":
            self._ready.add(rank)
            if len(self._ready) == self.size:
                self._started.set()
        elif kind == "fatal":
            if len(self._ready) < self.size and self._startup_error is None:
                self._startup_error = from_reply(message, f"data-parallel rank {rank}")
            reason = f"data-parallel rank {rank} failed: {message.get('type')}: " \
                     f"{message.get('message')}"
            if message.get("type") == PeerError.__name__:  # a collective failed: name the dead
                dead = self._dead_peer(rank, _PEER_EXIT_GRACE_S)
                if dead is not None:
                    reason = f"data-parallel rank {dead[0]} exited with code {dead[1]} ({reason})"
            self._fail(reason)

    def _call(self, rank: int, op: str, *args: Any) -> Future[Any]:
        future: Future[Any] = Future()
        with self._lock:
            if self._broken is not None:
                return _failed(RemoteEngineDeadError(
                    f"the data-parallel engine stopped: {self._broken}"))
            if self._closing:
                return _failed(PeerError("the data-parallel engine is shut down"))
            call_id = next(self._ids)
            self._calls[call_id] = (rank, future)
        payload = wire.encode({"op": op, "id": call_id, "args": list(args)})
        with self._outbox_lock:
            self._outbox.send([f"rank-{rank}".encode(), payload])
        return future

    def _everyone(self, op: str, *args: Any) -> Future[list[Any]]:
        return _all([self._call(rank, op, *args) for rank in range(self.size)])

    def rank_call(self, rank: int, command: str, *args: Any) -> Future[Any]:
        """Send one command to one rank only (diagnostics and protocol tests: e.g. a pause
        that reaches the ranks at different times)."""
        if not 0 <= rank < self.size:
            raise ConfigError(f"rank must be in 0..{self.size - 1}, got {rank}")
        check_command(command)
        if command == "add_request":
            raise ConfigError("add requests through submit('add_request', ...)")
        return self._call(rank, command, *args)

    # -- commands --------------------------------------------------------------------------

    def submit(self, command: str, *args: Any) -> Future[Any]:
        """Run one of `COMMANDS` across the ranks (see the module docstring)."""
        try:
            check_engine_call(command, args)
            if command == "add_request":
                return self._add_request(*args)
            if command == "abort":
                return self._abort(*args)
            if command == "pause":  # resolves to a second future, like EngineCore's
                mode, clear_cache = args
                return _done(_then(self._everyone("pause", check_pause_mode(mode),
                                                  bool(clear_cache)), lambda _: None))
            if command == "stats":
                return _then(self._everyone("stats"), self._stats)
            if command == "rollback_weights":
                return self._rollback_everywhere()
            combine = _COMBINE.get(command, lambda _: None)
            return _then(self._everyone(command, *args), combine)
        except Exception as exc:
            return _failed(exc)

    def _rollback_everywhere(self) -> Future[None]:
        """Every rank reserves its rollback; all roll back, or (one could not) every rank that
        reserved lets go and the future fails with `LifecycleError` naming each refusing
        rank: the ranks never end on different versions. On a thread of its own (the io
        thread, which completes the ranks' futures, must never wait on them)."""
        out: Future[None] = Future()

        def run() -> None:
            if not out.set_running_or_notify_cancel():  # (the caller gave up already)
                return
            try:
                self._rollback_in_two_phases()
            except BaseException as exc:
                out.set_exception(exc)
            else:
                out.set_result(None)

        threading.Thread(target=run, name="wtransfer-dp-rollback", daemon=True).start()
        return out

    def _rollback_in_two_phases(self) -> None:
        timeout = self.config.call_timeout_s
        deadline = time.monotonic() + timeout  # (both phases within one call's deadline)
        reserving = [self._call(rank, "reserve_rollback") for rank in range(self.size)]
        futures.wait(reserving, timeout=timeout)
        held = [rank for rank, f in enumerate(reserving) if f.done() and f.exception() is None]
        if len(held) == self.size:
            going = _all([self._call(rank, "rollback_weights", True)
                          for rank in range(self.size)])
            try:
                going.result(timeout=max(0.0, deadline - time.monotonic()))
            except futures.TimeoutError:
                raise TransferTimeout(f"the data-parallel ranks did not all roll back within "
                                      f"{timeout:g}s; their versions may differ (weight_info "
                                      f"says)") from None
            return
        for rank in held:  # (best effort: a rank that cannot answer is failing anyway)
            self._call(rank, "release_rollback")
        for rank, f in enumerate(reserving):
            if not f.done():  # a rank that reserves after all: let it go then
                f.add_done_callback(self._release_if_reserved(rank))
        refused = [f.exception() if f.done() else TransferTimeout(
                       f"data-parallel rank {rank} did not reserve its rollback within "
                       f"{timeout:g}s")
                   for rank, f in enumerate(reserving) if rank not in held]
        other = [exc for exc in refused if not isinstance(exc, LifecycleError)]
        if other:
            raise other[0]  # type: ignore[misc]
        raise LifecycleError("no rank rolled back: " + "; ".join(
            str(exc) for exc in refused))  # (each names its rank)

    def _release_if_reserved(self, rank: int) -> Callable[[Future[Any]], None]:
        """A done-callback: `rank`'s late reservation, if it succeeded, is let go (it only
        queues the message)."""
        def release(reserved: Future[Any]) -> None:
            if reserved.exception() is None:
                self._call(rank, "release_rollback")
        return release

    def _outstanding(self) -> list[int]:
        """Unfinished requests per rank (call under the lock)."""
        counts = [0] * self.size
        for rank, _ in self._live.values():
            counts[rank] += 1
        return counts

    def _add_request(self, request_id: str, prompt: list[int],
                     params: SamplingParams | dict[str, Any]) -> Future[None]:
        params = parse_record(SamplingParams, params, where="sampling_params")
        with self._lock:
            if request_id in self._live:
                raise ConfigError(f"request id {request_id!r} is already running")
            outstanding = self._outstanding()
            rank = min(range(self.size), key=lambda r: (outstanding[r], r))
            self._live[request_id] = (rank, list(prompt))
        future = self._call(rank, "add_request", request_id, list(prompt), record_to_wire(params))

        def undo_if_refused(f: Future[Any]) -> None:
            if f.exception() is not None:
                with self._lock:
                    self._live.pop(request_id, None)

        future.add_done_callback(undo_if_refused)
        return future

    def _abort(self, request_ids: list[str] | None) -> Future[int]:
        if request_ids is None:
            return _then(self._everyone("abort", None), sum)
        by_rank: dict[int, list[str]] = {}
        with self._lock:
            for rid in request_ids:
                if rid in self._live:
                    by_rank.setdefault(self._live[rid][0], []).append(rid)
        return _then(_all([self._call(r, "abort", ids) for r, ids in by_rank.items()]), sum)

    def _stats(self, per_rank: list[Any]) -> dict[str, Any]:
        with self._lock:
            outstanding = self._outstanding()
        return {**_merge_stats(per_rank), "outstanding": outstanding,
                "waves_relayed": self.waves_relayed}

    # -- shutdown --------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Abort live requests on every rank, stop the ranks, close the sockets."""
        if self._closing:
            return
        timeout = self.config.step_timeout_s
        if self._broken is None:
            try:  # the global pause takes every rank out of its wave before any of them exits
                self._everyone("pause", "abort", True).result(timeout=timeout)
                self._everyone("shutdown").result(timeout=timeout)
            except Exception as exc:
                log.warning("data-parallel shutdown was not clean: %s", exc)
        self._closing = True
        deadline = time.monotonic() + timeout
        for proc in self._procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout)
        self._io.join(timeout)
        with self._lock:
            calls, self._calls = self._calls, {}
        for _, future in calls.values():
            if not future.done():
                future.set_exception(PeerError("the data-parallel engine is shut down"))
        self._outbox.close()
        self._inbox.close()
        self._router.close()

