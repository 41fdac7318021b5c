"""`TPWorkers`: a replica's tensor-parallel workers, seen from rank 0 (the replica itself).

Rank 0 starts N-1 `worker` processes and forms the group's collective with them through a
store it hosts. Two channels:

- **the collective** (gloo on CPU, NCCL on CUDA), used only by rank 0's engine thread: every
  forward's plan (`step`), and what must happen on every rank at the same step boundary
  (`sync`: a staged commit, a rollback, a fingerprint, shutdown); the workers follow in order;
- **commands** (ZeroMQ, msgpack): the weight-transfer calls (`call_all`), which each worker runs
  on a thread of its own beside its step loop (so a staged update lands while the group keeps
  stepping) and answers; every wait has the call's deadline and notices a dead worker.

A worker that dies breaks the collective: rank 0's next step raises `EngineDeadError`, the
engine reports dead and its requests end with an error.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from wtransfer.errors import ConfigError, EngineDeadError, TransferTimeout, reply_result
from wtransfer.fingerprint import tensor_digest
from wtransfer.inference.config import EngineConfig
from wtransfer.inference.model.parallel import Collective, collective_backend
from wtransfer.inference.steps.runner import StepPlan
from wtransfer.records import TensorLayout
from wtransfer.transport.channel import Channel, receive_record, send_record

_SLICE_S = 0.005


class TPWorkers:
    """Ranks 1..N-1 of a replica's tensor-parallel group (see the module docstring)."""

    def __init__(self, config: EngineConfig, *, first_worker: int, staging: str,
                 rollback: bool, device: torch.device) -> None:
        self.size = config.tensor_parallel_size
        self.timeout_s = config.step_timeout_s
        self._last_sync = time.monotonic()
        self.call_timeout_s = config.call_timeout_s
        self._channel = Channel.serve()
        address = self._channel.address
        self._store = dist.TCPStore("127.0.0.1", 0, None, True,
                                    timedelta(seconds=self.timeout_s), wait_for_workers=False)
        self._lock = threading.Lock()
        self._replies: dict[int, Any] = {}
        self._next_id = 0
        spec = json.dumps(dataclasses.asdict(config))
        self.procs = [subprocess.Popen(
            [sys.executable, "-m", "wtransfer.inference.tp.worker", "--config", spec,
             "--rank", str(rank), "--store", f"127.0.0.1:{self._store.port}",
             "--commands", address, "--first-worker", str(first_worker),
             "--staging", staging, "--rollback", str(int(rollback))])
            for rank in range(1, self.size)]
        try:
            self._await_loaded()
            self.collective = Collective(dist.PrefixStore("wtransfer-tp/", self._store), 0,
                                         self.size, self.timeout_s, device,
                                         collective_backend(config, first_worker))
        except BaseException:
            self._kill()
            raise
        self.layouts: list[dict[str, TensorLayout]] = []
        """Every rank's layouts (rank 0's first), for assembling full tensors."""

    def _await_loaded(self) -> None:
        """Wait until every worker loaded its model (or one says why it could not)."""
        waiting = set(range(1, self.size))
        deadline = time.monotonic() + self.call_timeout_s
        while waiting:
            if time.monotonic() > deadline:
                raise TransferTimeout(f"tensor-parallel workers {sorted(waiting)} did not start "
                                      f"within {self.call_timeout_s:g}s")
            self._check_alive()
            if not self._channel.wait(100):
                continue
            received = receive_record(self._channel)
            assert received is not None
            identity, message = received
            rank = int((identity or b"").decode().removeprefix("tp-"))
            if message.get("kind") == "fatal":
                raise ConfigError(f"tensor-parallel worker {rank} failed to start: "
                                  f"{message.get('type')}: {message.get('message')}")
            waiting.discard(rank)

    def _check_alive(self) -> None:
        dead = [(i + 1, p.returncode) for i, p in enumerate(self.procs) if p.poll() is not None]
        if dead:
            rank, code = dead[0]
            raise EngineDeadError(f"tensor-parallel worker {rank} exited (code {code})")

    # -- the collective (rank 0's engine thread only) ---------------------------------------

    def step(self, plan: StepPlan) -> None:
        """Every worker computes `plan` with rank 0."""
        self.sync("step", **plan.to_wire())

    def sync(self, op: str, **fields: Any) -> None:
        """Every worker does `op` at this step boundary ("commit", "rollback", ...)."""
        self.collective.broadcast_record({"op": op, **fields})
        self._last_sync = time.monotonic()

    def sync_done(self, op: str, **fields: Any) -> None:
        """`sync(op)` and wait until every worker has done it (a "commit"): a
        weight-transfer command sent after it (the next update's start levels the shadow)
        reaches workers whose weights already changed."""
        self.sync(op, **fields)
        self.collective.barrier()

    def reserve_rollback(self, *, hold: bool) -> list[str]:
        """Every worker reserves its rollback (rank 0 has: it checked first); returns each
        refusing worker's reason, named. Where one refused, none holds a reservation when
        this returns; else each rolls back on a later `sync("rollback")`, or lets go on
        `sync_done("rollback_release")`."""
        self.sync("rollback_reserve", hold=hold)
        refusals = self.collective.all_gather_records(None)
        self.collective.barrier()
        return [f"tensor-parallel worker {rank}: {reason}"
                for rank, reason in enumerate(refusals) if reason is not None]

    def keepalive(self) -> None:
        """An idle engine tells its workers it is there (op "idle") a few times per
        `step_timeout_s`: they wait on the next message within that deadline, so that a dead
        rank 0 is noticed, and an engine idle for longer must not look dead to them."""
        if time.monotonic() - self._last_sync > self.timeout_s / 4:
            self.sync("idle")

    def fingerprint(self, local: dict[str, torch.Tensor]) -> dict[str, str]:
        """Per-tensor digest of the full tensors, assembled from every rank's part."""
        self.sync("fingerprint")
        out = {}
        for name in sorted(local):
            parts = self.collective.all_gather(local[name].detach())
            first = self.layouts[0][name]
            full = torch.empty(first.shape, dtype=parts[0].dtype)
            for layout, part in zip((lay[name] for lay in self.layouts), parts, strict=True):
                layout.place(part.cpu(), full)
            out[name] = tensor_digest(full)
        return out

    # -- commands ----------------------------------------------------------------------------

    def call_all(self, command: str, args: Sequence[Any]) -> list[int]:
        """Send a weight-transfer command to every worker; returns the call ids to `wait` on."""
        ids = []
        with self._lock:
            for rank in range(1, self.size):
                call_id, self._next_id = self._next_id, self._next_id + 1
                send_record(self._channel, {"id": call_id, "op": command,
                                            "args": list(args)}, to=f"tp-{rank}".encode())
                ids.append(call_id)
        return ids

    def wait(self, ids: list[int], what: str) -> list[Any]:
        """Every worker's answer to the calls `ids`, in rank order; the first failure raised
        (named by its worker), `TransferTimeout` past the call deadline."""
        deadline = time.monotonic() + self.call_timeout_s
        results: dict[int, Any] = {}
        while len(results) < len(ids):
            with self._lock:
                for call_id in ids:
                    if call_id in self._replies:
                        results[call_id] = self._replies.pop(call_id)
                if len(results) == len(ids):
                    break
                if self._channel.wait(int(_SLICE_S * 1000)):
                    for _ in range(64):
                        received = receive_record(self._channel, block=False)
                        if received is None:
                            break
                        message = received[1]
                        self._replies[int(message["id"])] = message
            self._check_alive()
            if time.monotonic() > deadline:
                raise TransferTimeout(f"{what}: tensor-parallel workers did not answer within "
                                      f"{self.call_timeout_s:g}s")
        return [reply_result(results[call_id], f"{what} on tensor-parallel worker {rank}")
                for rank, call_id in enumerate(ids, start=1)]

    def close(self) -> None:
        """Tell every worker to stop, then wait for them (killed past the deadline)."""
        with contextlib.suppress(EngineDeadError):  # a worker already gone: the others see
            self.sync("shutdown")  # the broken group and exit
        deadline = time.monotonic() + self.timeout_s
        for proc in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
        self._channel.close()

    def _kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        self._channel.close()
