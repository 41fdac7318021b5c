"""A tensor-parallel worker process: rank r of a replica's group (see `workers`).

Run by rank 0 as ``python -m wtransfer.inference.tp.worker``. It loads the model, keeps its
shard, joins the group's collective, then follows rank 0: every broadcast message is one
forward to compute with it (``step``) or something to do at that step boundary (``commit``,
``rollback_reserve`` then ``rollback`` or ``rollback_release``, ``fingerprint``,
``shutdown``), or ``idle``: an engine with nothing to step says
it is alive, within the deadline each worker waits for the next message. Weight-transfer
commands arrive on the command socket and run on a thread of their own (one at a time, in
order), beside the step loop.

Messages on the command channel (`wtransfer.transport.channel`, msgpack): worker to rank 0
``{"kind": "loaded"}`` once the model is in memory, or ``{"kind": "fatal", type, message}``;
rank 0 to worker ``{"id", "op", "args"}`` (the DP ranks' calls have the same envelope), answered
``{"id", "ok": true, "result"}`` or ``{"id"}`` with the fields of
`wtransfer.errors.error_reply`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

from wtransfer.errors import WTransferError, error_reply, ok_reply
from wtransfer.inference.config import EngineConfig
from wtransfer.inference.model.decoder import load_model, shard_model
from wtransfer.inference.model.fp8_linear import quantize_model
from wtransfer.inference.model.parallel import (
    Collective,
    Parallel,
    collective_backend,
    layouts,
    worker_device,
)
from wtransfer.inference.steps.runner import ModelRunner, StepPlan
from wtransfer.inference.tp.shard import ShardWeights
from wtransfer.packing import dtype_name
from wtransfer.transport.channel import Channel, receive_record, send_record
from wtransfer.transport.stacks import print_stacks_on_sigusr1
from wtransfer.wire import parse_record

log = logging.getLogger("wtransfer.tp")
COMMANDS = ("init_weight_transfer_engine", "start_weight_update", "update_weights",
            "stage_weight_update", "discard_weight_update", "fail_update", "finish_weight_update",
            "info")
"""What rank 0 may ask a worker on the command socket."""


class Worker:
    """One worker's model shard, receiver and runner, and its two loops."""

    def __init__(self, config: EngineConfig, rank: int, store: dist.Store, socket: Channel,
                 first_worker: int, staging: str, rollback: bool) -> None:
        self.config, self.rank, self.socket = config, rank, socket
        self.device = worker_device(config, first_worker, rank)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        full = load_model(config.model, device="cpu", dtype=config.dtype, seed=config.seed)
        checkpoint_dtype = dtype_name(full.model.embed_tokens.weight.dtype)
        if config.quantization == "fp8":
            quantize_model(full)
        send_record(socket, {"kind": "loaded"})
        size = config.tensor_parallel_size
        self.collective = Collective(dist.PrefixStore("wtransfer-tp/", store), rank, size,
                                     config.step_timeout_s, self.device,
                                     collective_backend(config, first_worker))
        par = Parallel(rank, size, config.enable_expert_parallel, self.collective)
        self.model = shard_model(full, par).to(self.device)
        self.weights = ShardWeights(
            self.model, layouts(full.config, par, full.state_dict()),
            backend=config.weight_transfer_backend, device=str(self.device),
            worker_index=first_worker + rank, staging=staging,  # type: ignore[arg-type]
            rollback=rollback,
            checkpoint_dtype=checkpoint_dtype if config.quantization == "fp8" else None)
        del full
        self.runner = ModelRunner(self.model, config)
        self._parent = os.getppid()
        self._stop = threading.Event()
        self._rollback_reserved = False
        """Whether this worker holds a rollback reserved (`reserve_rollback`)."""

    def serve_commands(self) -> None:
        """The command thread: run each weight-transfer command in order and answer it."""
        while not self._stop.is_set():
            if not self.socket.wait(200):
                if os.getppid() != self._parent:
                    return
                continue
            received = receive_record(self.socket)
            assert received is not None
            message = received[1]
            call_id, command, args = message["id"], message["op"], message["args"]
            try:
                if command not in COMMANDS:
                    raise WTransferError(f"unknown tensor-parallel worker command {command!r}")
                reply = ok_reply(getattr(self.weights, command)(*args))
            except Exception as exc:
                reply = error_reply(exc)
            send_record(self.socket, {"id": call_id, **reply})

    def follow(self) -> None:
        """The step loop: do what rank 0 broadcasts, until shutdown."""
        while True:
            message = self.collective.broadcast_record(None)
            op = message["op"]
            if op == "step":
                self.runner.execute(StepPlan.from_wire(message))
            elif op == "commit":
                self.weights.commit(str(message["previous"]))
                self.collective.barrier()  # done: rank 0 goes on (sync_done)
            elif op == "rollback_reserve":
                self.reserve_rollback(hold=bool(message["hold"]))
            elif op in ("rollback", "rollback_release"):
                self.finish_rollback(go=op == "rollback")
            elif op == "fingerprint":
                state = self.model.state_dict()
                for name in sorted(state):
                    self.collective.all_gather(state[name].detach())
            elif op == "shutdown":
                return
            # "idle": rank 0 is alive and has nothing to step

    def reserve_rollback(self, *, hold: bool) -> None:
        """Rank 0's rollback, first half: say whether this worker can roll back (its reason if
        not) and hold it ready only if every rank can, so that no rank ends on another
        version than the others."""
        refusal: str | None = None
        try:
            self.weights.reserve_rollback(hold=hold)
        except WTransferError as exc:
            refusal = str(exc) or type(exc).__name__
        try:
            refusals = self.collective.all_gather_records(refusal)
        except BaseException:
            if refusal is None:
                self.weights.release_rollback()
            raise
        self._rollback_reserved = refusal is None and all(r is None for r in refusals)
        if refusal is None and not self._rollback_reserved:
            self.weights.release_rollback()
        self.collective.barrier()

    def finish_rollback(self, go: bool) -> None:
        """Rank 0's rollback, second half: roll back what was reserved (`go`), or let go."""
        if self._rollback_reserved:
            self._rollback_reserved = False
            if go:  # (a failure here ends this worker: rank 0 then finds the group dead)
                self.weights.rollback_weights(reserved=True)
            else:
                self.weights.release_rollback()
        self.collective.barrier()

    def close(self) -> None:
        """Stop the command thread and release the receiver."""
        self._stop.set()
        self.weights.shutdown()


def main(argv: list[str] | None = None) -> int:
    """Entry point of a worker process."""
    print_stacks_on_sigusr1()
    parser = argparse.ArgumentParser(description="one tensor-parallel engine worker")
    parser.add_argument("--config", required=True, help="EngineConfig as JSON")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--store", required=True, help="host:port of rank 0's store")
    parser.add_argument("--commands", required=True, help="rank 0's command address")
    parser.add_argument("--first-worker", type=int, required=True)
    parser.add_argument("--staging", required=True)
    parser.add_argument("--rollback", type=int, required=True)
    args = parser.parse_args(argv)
    socket = Channel.connect(args.commands, identity=f"tp-{args.rank}", linger_ms=1000)
    worker: Worker | None = None
    try:
        config = parse_record(EngineConfig, json.loads(args.config), where="--config")
        host, port = args.store.rsplit(":", 1)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // config.tensor_parallel_size))
        store = dist.TCPStore(host, int(port), None, False,
                              timedelta(seconds=config.step_timeout_s))
        worker = Worker(config, args.rank, store, socket, args.first_worker, args.staging,
                        bool(args.rollback))
    except Exception as exc:
        send_record(socket, {"kind": "fatal", **error_reply(exc)})
        socket.close(linger_ms=1000)
        return 1
    commands = threading.Thread(target=worker.serve_commands, name="wtransfer-tp-commands",
                                daemon=True)
    commands.start()
    try:
        worker.follow()
    except WTransferError as exc:  # rank 0 went away or a peer died: nothing to serve
        log.error("tensor-parallel worker %d stops: %s", args.rank, exc)
        return 1
    finally:
        worker.close()
        commands.join(timeout=5)
        socket.close(linger_ms=1000)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
