"""Control-plane clients: how a sender reaches one or many receiving engines.

Every client speaks `wtransfer.sender.WeightSyncClient`. `LocalClient` calls an engine in the
same process; `wtransfer.rpc.RPCClient` reaches a receiver in another process; `HTTPClient`
(`wtransfer.inference.http_client`) a `wtransfer serve` server; `FanoutClient` sends each call
to several engine instances at once (engines behind an external load balancer).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from wtransfer.calls import CallQueue, PendingCall
from wtransfer.errors import (
    ConfigError,
    IntegrityError,
    PeerError,
    TransferTimeout,
    remote_error,
)
from wtransfer.infos import check_version
from wtransfer.receiver import WeightTransferEngine
from wtransfer.sender import InitFor, WeightSyncClient

T = TypeVar("T")


class SingleEngineClient:
    """Mixin for a client that reaches exactly one engine instance: `init_each_engine` is its
    `init_weight_transfer_engine` with the info for workers ``0 .. num_workers()-1``."""

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """Initialize the engine (implemented by the client)."""
        raise NotImplementedError

    def num_workers(self) -> int:
        """Receiving workers behind the engine; 1 unless the client knows better."""
        return 1

    def init_each_engine(self, info_for: InitFor) -> None:
        """Initialize the one engine with ``info_for(0, num_workers())``."""
        self.init_weight_transfer_engine(info_for(0, self.num_workers()))


def check_workers(client: object, count: object) -> int:
    """`count` if it is a valid worker count, else `ConfigError` naming the client."""
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise ConfigError(f"{client!r} reports num_workers={count!r}; expected an int >= 1")
    return count


class LocalClient(SingleEngineClient):
    """Drives a `WeightTransferEngine` living in this process (no serialization)."""

    def __init__(self, engine: WeightTransferEngine[Any, Any]) -> None:
        self.engine = engine
        self.weight_version: str | None = None
        """Label given by the last successful `finish_weight_update`."""

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """Initialize the engine."""
        self.engine.init_transfer_engine(init_info)

    def start_weight_update(self) -> None:
        """Open an update on the engine."""
        self.engine.start_weight_update()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Deliver one part of the update."""
        self.engine.update_weights(update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """Finish the update and record `weight_version` (a bad label is refused before the
        update closes, as every engine does)."""
        if weight_version is not None:
            check_version(weight_version)
        self.engine.finish_weight_update()
        if weight_version is not None:
            self.weight_version = weight_version

    def fingerprint(self) -> dict[str, str]:
        """Digest of the engine's target."""
        return self.engine.target.fingerprint()

    def __repr__(self) -> str:
        return f"LocalClient({type(self.engine).__name__})"


class FanoutClient:
    """Sends every call to each client concurrently; a failure names the instance.

    Used for independent engines behind an external load balancer: each instance receives the
    same weights. `fingerprint()` returns the common digest and raises `IntegrityError` when the
    instances disagree.
    """

    def __init__(self, clients: Sequence[WeightSyncClient]) -> None:
        if not clients:
            raise ConfigError("FanoutClient needs at least one client")
        self.clients = list(clients)
        self._pool = ThreadPoolExecutor(max_workers=len(self.clients),
                                        thread_name_prefix="wtransfer-fanout")
        self._queues: list[CallQueue] | None = None

    def map(self, call: Callable[[WeightSyncClient, int], T]) -> list[T]:
        """Run `call(client, index)` on every client at once; raise on any failure."""
        futures = [self._pool.submit(call, c, i) for i, c in enumerate(self.clients)]
        results: list[T] = []
        failures: list[tuple[int, BaseException]] = []
        for i, fut in enumerate(futures):
            try:
                results.append(fut.result())
            except Exception as exc:
                failures.append((i, exc))
        if failures:
            raise self.failed(failures)
        return results

    def failed(self, failures: list[tuple[int, BaseException]]) -> Exception:
        """One error for the instances that failed (index, error), led by the first that is
        not a timeout (others often time out only because of it): a `PeerError` of its kind
        (`errors.remote_error`), or `TransferTimeout` when every one timed out; the message
        names each instance."""
        first = next((e for _, e in failures if not isinstance(e, TransferTimeout)),
                     failures[0][1])
        where = ", ".join(f"#{j} ({self.clients[j]!r})" for j, _ in failures)
        message = f"{len(failures)} of {len(self.clients)} instance(s) failed: {where}; " \
                  f"first error: {type(first).__name__}: {first}"
        kind = first.remote_type if isinstance(first, PeerError) and first.remote_type \
            else type(first).__name__
        error = TransferTimeout(message) if isinstance(first, TransferTimeout) \
            else remote_error(message, kind)
        error.__cause__ = first
        return error

    def submit(self, method: str, *, after: FanoutCall | None = None,
               **args: Any) -> FanoutCall:
        """Issue ``method(**args)`` on every instance without waiting (pipelined on each
        instance whose client pipelines; in submission order per instance either way). With
        `after`, each instance runs it only if its part of that call succeeded."""
        if self._queues is None:
            self._queues = [CallQueue(c) for c in self.clients]
        if after is not None and after.fanout is not self:
            raise TypeError("'after' must be a call of this FanoutClient")
        return FanoutCall(self, [
            q.submit(method, after=after.calls[i] if after is not None else None, **args)
            for i, q in enumerate(self._queues)])

    def workers_per_engine(self) -> list[int]:
        """Receiving workers behind each client, in order."""
        return [check_workers(c, n) for c, n in zip(
            self.clients, self.map(lambda c, _: c.num_workers()), strict=True)]

    def num_workers(self) -> int:
        """Receiving workers behind every client together."""
        return sum(self.workers_per_engine())

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """Initialize every instance with the same init info."""
        self.map(lambda c, _: c.init_weight_transfer_engine(init_info))

    def init_each_engine(self, info_for: InitFor) -> None:
        """Initialize client i's engines with ``info_for(first, n)``, where `first` counts the
        workers of clients 0..i-1 and `n` is client i's own."""
        counts = self.workers_per_engine()
        firsts = [sum(counts[:i]) for i in range(len(counts))]
        self.map(lambda c, i: c.init_each_engine(
            lambda first, n: info_for(firsts[i] + first, n)))

    def start_weight_update(self) -> None:
        """Open an update on every instance."""
        self.map(lambda c, _: c.start_weight_update())

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Deliver the same update part to every instance."""
        self.map(lambda c, _: c.update_weights(update_info))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """Finish on every instance with the same version label."""
        self.map(lambda c, _: c.finish_weight_update(weight_version))

    def fingerprint(self) -> dict[str, str]:
        """The digest all instances agree on; `IntegrityError` naming those that differ."""
        prints = self.map(lambda c, _: c.fingerprint())
        odd = [i for i, p in enumerate(prints) if p != prints[0]]
        if odd:
            raise IntegrityError(f"instances {odd} hold different weights from instance 0")
        return prints[0]

    def close(self) -> None:
        """Stop the worker threads."""
        self._pool.shutdown(wait=False)
        for queue in self._queues or []:
            queue.close()

    def __repr__(self) -> str:
        return f"FanoutClient({self.clients!r})"


class FanoutCall:
    """One call issued on every instance of a `FanoutClient` (a `PendingCall`)."""

    def __init__(self, fanout: FanoutClient, calls: list[PendingCall]) -> None:
        self.fanout = fanout
        self.calls = calls

    def done(self) -> bool:
        """Whether every instance answered, or one failed (never blocks)."""
        finished = [call for call in self.calls if call.done()]
        if len(finished) == len(self.calls):
            return True
        for call in finished:
            try:
                call.result(0)
            except Exception:
                return True
        return False

    def result(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` for every instance; raise as `FanoutClient.map` does."""
        deadline = time.monotonic() + timeout_s
        failures: list[tuple[int, BaseException]] = []
        for i, call in enumerate(self.calls):
            try:
                call.result(max(0.0, deadline - time.monotonic()))
            except Exception as exc:
                failures.append((i, exc))
        if failures:
            raise self.fanout.failed(failures)

    def cancel(self) -> None:
        """Stop waiting on every instance."""
        for call in self.calls:
            call.cancel()
