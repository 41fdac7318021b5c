"""A failed weight-transfer call fails once, on the last worker, for every worker.

vLLM 0.32's multiprocess executor reads the workers' replies to a ``collective_rpc`` in rank
order and stops at the first failure: the replies of the workers after it stay queued and are
read by the next call, so from then on every call is answered with an earlier call's results
(fingerprints of the wrong call, a stale error on a good update). Seen with a trainer rank
killed mid-transfer into vLLM with tensor_parallel_size=2.

So each worker runs its part of a weight-transfer call, then the workers exchange whether
theirs failed (a fixed-size byte tensor over the CPU group of this engine's workers, no
pickle), and only the
last worker raises: its own failure, or the first failed worker's, named by index and of the
same kind. Every reply before it is then a success, and nothing is left queued. The other
workers, the last included, end the failed update as vLLM's worker does when a call raises on
it (no update active, the engine's update target reset), so the next update starts on every
worker. The exchange waits at most the trainer's deadline.

`install` puts this around the weight-transfer methods of the vLLM worker that builds our
engine (as attributes of that worker object: ``collective_rpc`` finds methods by name).
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import torch

from wtransfer.errors import TransferTimeout, error_kind, relayed_kind, remote_error

log = logging.getLogger("wtransfer.vllm")

T = TypeVar("T")

WORKER_METHODS = ("init_weight_transfer_engine", "start_weight_update", "update_weights",
                  "finish_weight_update")
"""The vLLM worker's weight-transfer methods a trainer reaches by ``collective_rpc``."""

MESSAGE_BYTES = 4096
"""A failure's text travels in this many bytes (longer ones are cut)."""

EXCHANGE_TIMEOUT_S = 300.0
"""How long a worker waits for the others' verdicts before the trainer set a deadline."""


def _workers() -> Any:
    """vLLM's group of exactly the workers of this engine's executor (whose replies one
    ``collective_rpc`` reads): its tensor-parallel group without pipeline parallelism, its
    world without data parallelism; None for one worker, or where neither is that group."""
    from vllm.distributed import parallel_state

    world = getattr(parallel_state, "_WORLD", None)
    tp = getattr(parallel_state, "_TP", None)
    pp = getattr(parallel_state, "_PP", None)
    if world is None or tp is None or pp is None:
        return None
    group = tp if pp.world_size == 1 else (
        world if world.world_size == tp.world_size * pp.world_size else None)
    return group if group is not None and group.world_size > 1 else None


def _encode(failure: BaseException | None) -> torch.Tensor:
    out = torch.zeros(MESSAGE_BYTES, dtype=torch.uint8)
    if failure is not None:
        text = str(failure)
        if relayed_kind(text) is None:
            text = f"{error_kind(failure)}: {text}"
        data = text.encode()[:MESSAGE_BYTES - 1]
        out[0] = 1
        out[1:1 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return out


def _decode(record: torch.Tensor) -> str:
    return bytes(record[1:].tolist()).rstrip(b"\0").decode(errors="replace")


def fail_together(call: Callable[[], T], timeout_s: float, ended: Callable[[], None]
                  ) -> T | None:
    """Run `call` on this worker; then, if it failed on any worker, every worker calls
    `ended` and only the last raises (see the module docstring); the others return None.
    `TransferTimeout` where the other workers do not answer within `timeout_s`."""
    group = _workers()
    if group is None:
        try:
            return call()
        except BaseException:
            ended()  # vLLM's worker does this for a failed update call, not a failed finish
            raise
    failure: BaseException | None = None
    result: T | None = None
    try:
        result = call()
    except BaseException as exc:  # every worker must reach the exchange
        failure = exc
    records = [torch.empty(MESSAGE_BYTES, dtype=torch.uint8) for _ in range(group.world_size)]
    work = torch.distributed.all_gather(records, _encode(failure), group=group.cpu_group,
                                        async_op=True)
    try:
        work.wait(timeout=timedelta(seconds=timeout_s))
    except RuntimeError as exc:
        raise TransferTimeout(f"the other vLLM workers did not say within {timeout_s:.0f}s "
                              f"whether their part of the call failed ({exc})") from failure
    failed = [(i, _decode(r)) for i, r in enumerate(records) if int(r[0])]
    if not failed:
        return result
    ended()
    if group.rank_in_group != group.world_size - 1:
        return None
    if failure is not None and failed[0][0] == group.rank_in_group:
        raise failure
    index, text = failed[0]
    raise remote_error(f"{text} (on vLLM worker {index} of {group.world_size})",
                       relayed_kind(text) or "PeerError")


def _building_worker() -> Any:
    """The vLLM worker whose code is building our engine (up the call stack), or None."""
    frame = inspect.currentframe()
    while frame is not None:
        candidate = frame.f_locals.get("self")
        if candidate is not None and hasattr(candidate, "_weight_update_active"):
            return candidate
        frame = frame.f_back
    return None


def install() -> Callable[[], None] | None:
    """Put `fail_together` around the weight-transfer methods of the vLLM worker building
    our engine (see the module docstring); a warning where none is found. Returns what ends
    a failed update on that worker, as vLLM's worker does when a call raises on it (None
    without a worker)."""
    worker = _building_worker()
    if worker is None:
        log.warning("wtransfer-vllm: no vLLM worker found building the weight-transfer "
                    "engine; with several workers a failed update may leave vLLM's replies "
                    "out of step")
        return None

    def ended() -> None:  # what vLLM's worker does when an update call raises on it
        worker._weight_update_active = False
        engine = worker.weight_transfer_engine
        engine.receiver.fail_update("the update failed on another vLLM worker")
        engine.reset_weight_update_target()

    def timeout_s() -> float:  # the trainer's deadline, once it set one
        info = worker.weight_transfer_engine.receiver.init_info
        return float(info.timeout_s) if info is not None else EXCHANGE_TIMEOUT_S

    for name in WORKER_METHODS:
        original = getattr(worker, name)

        def together(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
            return fail_together(lambda: _original(*args, **kwargs), timeout_s(), ended)

        setattr(worker, name, functools.wraps(original)(together))
    return ended
