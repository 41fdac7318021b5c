"""Control-plane clients: how a sender reaches one or many receiving engines.

Every client speaks `wtransfer.protocol.WeightSyncClient`. `LocalClient` calls an engine in
the same process; `wtransfer.rpc.RPCClient` reaches a receiver in another process;
`HTTPClient` speaks the RL HTTP API that `wtransfer serve` serves (and `vllm serve`, through
`wtransfer_vllm.ServerClient`); `FanoutClient` sends each call to several engine instances at
once (engines behind an external load balancer).

`HTTPClient` also speaks the server's other routes: pause, resume, is_paused, versions and
generate. Init and update infos travel as msgpack (they may hold bytes such as IPC handles);
every other body is JSON. Error replies become the `PeerError` of
`wtransfer.errors.from_reply` (a 409 is a `RemoteLifecycleError`, say); a request past its
deadline becomes `TransferTimeout`. It needs no HTTP library beyond the standard one
(`wtransfer.transport.http_client`; msgpack for its packed bodies); `http_session` (the
demo's and tests' clients) needs httpx (the `serve` extra), imported on first use.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal, TypeVar

from wtransfer import wire
from wtransfer.errors import (
    ConfigError,
    IntegrityError,
    LifecycleError,
    PeerError,
    TransferTimeout,
    WTransferError,
    from_reply,
    relayed_kind,
    remote_error,
)
from wtransfer.protocol import (
    BatchedCall,
    BatchRefused,
    CallQueue,
    InitFor,
    PendingCall,
    TwoPhaseClient,
    WeightSyncClient,
)
from wtransfer.receiver.engine import WeightTransferEngine
from wtransfer.records import (
    BATCHED_CALLS,
    MAX_BATCHED_CALLS,
    CallOutcome,
    PauseMode,
    WeightCall,
    check_pause_mode,
)
from wtransfer.transport.http_client import (
    CLIENT_KEEPALIVE_S,
    HTTPConnections,
    HTTPStatusError,
)
from wtransfer.wire import parse_record, record_to_wire

T = TypeVar("T")
log = logging.getLogger("wtransfer.control.clients")

MAX_BATCH_BYTES = 16 << 20
"""The largest batch of calls `HTTPClient` sends as one request (a server takes 64 MiB by
default); calls that would make one larger go one by one."""


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

    @property
    def weight_version(self) -> str | None:
        """The label of the engine's weights (its last labelled update's)."""
        return self.engine.weight_version

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """Initialize the engine."""
        self.engine.init_transfer_engine(init_info)

    def start_weight_update(self) -> None:
        """Open an update on the engine."""
        self.engine.start_weight_update()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Deliver one part of the update."""
        self.engine.update_weights(update_info)

    def stage_weight_update(self) -> None:
        """Check the open update without making it live."""
        self.engine.stage_weight_update()

    def discard_weight_update(self, reason: str) -> None:
        """Fail the open update on purpose."""
        self.engine.discard_weight_update(reason)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """Finish the update and label the weights `weight_version`."""
        self.engine.finish_weight_update(weight_version)

    def fingerprint(self) -> dict[str, str]:
        """Digest of the engine's target."""
        return self.engine.target.fingerprint()

    def __repr__(self) -> str:
        return f"LocalClient({type(self.engine).__name__})"


OnFailure = Literal["abort", "drop"]
"""What a `FanoutClient` does when an instance fails an update: "abort" it on every instance,
or "drop" the instance and land the update on the others."""


class FanoutClient:
    """A fleet of engine instances updated as one: every call goes to each instance concurrently.
    `on_failure="abort"` (default): an update lands on every instance or on none; "drop": a failed
    instance leaves the fleet (`TransferStats.dropped`). Errors name the failed instances. `add`
    joins one; `fingerprint()` raises `IntegrityError` when instances disagree (docs/fleets.md)."""

    def __init__(self, clients: Sequence[WeightSyncClient], *,
                 on_failure: OnFailure = "abort") -> None:
        if not clients:
            raise ConfigError("FanoutClient needs at least one client")
        if on_failure not in ("abort", "drop"):
            raise ConfigError(f"on_failure must be 'abort' or 'drop', got {on_failure!r}")
        self.clients = list(clients)
        self.on_failure: OnFailure = on_failure
        self.generation = 0
        """Counts changes of membership (an instance added or dropped)."""
        self.joined = 0
        """Counts instances added (`add`): a sender initializes the transport again."""
        self._dropped: list[str] = []
        self._pool = ThreadPoolExecutor(max_workers=64, thread_name_prefix="wtransfer-fanout")
        self._queues: dict[int, CallQueue] = {}

    def _queue(self, client: WeightSyncClient) -> CallQueue:
        """`client`'s own queue of calls (made on first use)."""
        queue = self._queues.get(id(client))
        if queue is None:
            queue = self._queues[id(client)] = CallQueue(client)
        return queue

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Calls submitted inside wait on every instance until it ends, then go together
        (one request to each instance whose client batches: `CallQueue.held`)."""
        with contextlib.ExitStack() as holds:
            for client in list(self.clients):
                holds.enter_context(self._queue(client).held())
            yield

    def add(self, client: WeightSyncClient) -> None:
        """Join an instance: the next update reaches it too (the sender initializes the
        transport to it first)."""
        self.clients.append(client)
        self.joined += 1
        self.generation += 1

    def prune(self) -> bool:
        """Drop the instances that no longer answer a short call (`num_workers`); whether
        any was dropped. Never drops the last one."""
        clients = list(self.clients)
        futures = [self._pool.submit(c.num_workers) for c in clients]
        silent: list[tuple[WeightSyncClient, BaseException]] = []
        for client, fut in zip(clients, futures, strict=True):
            try:
                fut.result(timeout=PRUNE_WAIT_S)
            except Exception as exc:  # (a timeout too: it does not answer)
                silent.append((client, exc))
        if not silent or len(silent) == len(clients):
            return False
        self._drop(silent)
        queues, self._queues = self._queues, {}  # the failed update's calls still queued
        for queue in queues.values():  # there end on their own; the retry's go out anew
            queue.close()
        return True

    def take_dropped(self) -> list[str]:
        """The instances dropped since the last call (their clients' reprs), once."""
        dropped, self._dropped = self._dropped, []
        return dropped

    def _drop(self, failures: list[tuple[WeightSyncClient, BaseException]]) -> None:
        for client, exc in failures:
            if client in self.clients:
                self.clients.remove(client)
                self._dropped.append(repr(client))
                self.generation += 1
                log.warning("fleet: dropped %r (%s: %s)", client, type(exc).__name__, exc)
                queue = self._queues.pop(id(client), None)
                if queue is not None:
                    queue.close()

    def settle(self, failures: list[tuple[WeightSyncClient, BaseException]], total: int
               ) -> None:
        """After a call on `total` instances: nothing when none failed; in drop mode the
        failed ones leave the fleet, unless none is left; else the error naming them."""
        if not failures:
            return
        if self.on_failure == "drop" and len(failures) < total:
            self._drop(failures)
            return
        raise self.failed(failures, total)

    def map(self, call: Callable[[WeightSyncClient, int], T]) -> list[T]:
        """Run `call(client, index)` on every instance at once; the results of those that
        succeeded (`settle` decides what a failure does)."""
        clients = list(self.clients)
        futures = [self._pool.submit(call, c, i) for i, c in enumerate(clients)]
        results: list[T] = []
        failures: list[tuple[WeightSyncClient, BaseException]] = []
        for client, fut in zip(clients, futures, strict=True):
            try:
                results.append(fut.result())
            except Exception as exc:
                failures.append((client, exc))
        self.settle(failures, len(clients))
        return results

    def failed(self, failures: list[tuple[WeightSyncClient, BaseException]],
               total: int | None = None) -> Exception:
        """One error for the instances that failed, led by the first that is not a timeout
        (others often time out only because of it): a `PeerError` of its kind
        (`errors.remote_error`), or `TransferTimeout` when every one timed out; the message
        names each instance."""
        first = next((e for _, e in failures if not isinstance(e, TransferTimeout)),
                     failures[0][1])
        where = ", ".join(repr(c) for c, _ in failures)
        message = f"{len(failures)} of {total or len(self.clients)} instance(s) failed: " \
                  f"{where}; first error: {type(first).__name__}: {first}"
        kind = first.remote_type if isinstance(first, PeerError) and first.remote_type \
            else type(first).__name__
        error = TransferTimeout(message) if isinstance(first, TransferTimeout) \
            else remote_error(message, kind)
        error.__cause__ = first
        return error

    def submit(self, method: str, *, after: PendingCall | None = None,
               **args: Any) -> PendingCall:
        """Issue ``method(**args)`` on every instance without waiting (pipelined on each
        instance whose client pipelines; in submission order per instance either way). With
        `after`, each instance runs it only if its part of that call succeeded. A finish runs
        in its two phases once `after` is settled (`finish_weight_update`)."""
        if after is not None and not isinstance(after, (FanoutCall, FleetFinish)):
            raise TypeError("'after' must be a call of this FanoutClient")
        if method == "finish_weight_update":
            return FleetFinish(self, after, args.get("weight_version"))
        calls = []
        for client in self.clients:
            before = after.of(client) if isinstance(after, FanoutCall) else None
            calls.append((client, self._queue(client).submit(method, after=before, **args)))
        return FanoutCall(self, calls)

    def workers_per_engine(self) -> list[int]:
        """Receiving workers behind each instance, in order."""
        counts = self.map(lambda c, _: (c, c.num_workers()))
        return [check_workers(c, n) for c, n in counts]

    def num_workers(self) -> int:
        """Receiving workers behind every instance together."""
        return sum(self.workers_per_engine())

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """Initialize every instance with the same init info."""
        self.map(lambda c, _: c.init_weight_transfer_engine(init_info))

    def init_each_engine(self, info_for: InitFor) -> None:
        """Initialize instance i's engines with ``info_for(first, n)``, where `first` counts
        the workers of instances 0..i-1 and `n` is instance i's own."""
        counts = self.workers_per_engine()
        firsts = {id(c): sum(counts[:i]) for i, c in enumerate(self.clients)}
        self.map(lambda c, _: c.init_each_engine(
            lambda first, n: info_for(firsts[id(c)] + first, n)))

    def start_weight_update(self) -> None:
        """Open an update on every instance."""
        self.map(lambda c, _: c.start_weight_update())

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Deliver the same update part to every instance."""
        self.map(lambda c, _: c.update_weights(update_info))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """Stage the update on every instance, then commit it on every one (see the class
        docstring); instances that cannot stage (`TwoPhaseClient`) finish in one call, with
        the others' commits."""
        clients = list(self.clients)
        futures = [self._pool.submit(self._stage, c) for c in clients]
        failures: list[tuple[WeightSyncClient, BaseException]] = []
        for client, fut in zip(clients, futures, strict=True):
            try:
                fut.result()
            except Exception as exc:
                failures.append((client, exc))
        if failures and (self.on_failure == "abort" or len(failures) == len(clients)):
            reason = f"another instance of the fleet failed it: {failures[0][1]}"[:500]
            failed = [f for f, _ in failures]
            staged = [c for c in clients if isinstance(c, TwoPhaseClient)
                      and not any(c is f for f in failed)]
            for fut in [self._pool.submit(c.discard_weight_update, reason) for c in staged]:
                with contextlib.suppress(Exception):  # the error to report is the failure
                    fut.result()
        self.settle(failures, len(clients))
        self.map(lambda c, _: c.finish_weight_update(weight_version))

    @staticmethod
    def _stage(client: WeightSyncClient) -> None:
        if isinstance(client, TwoPhaseClient):
            client.stage_weight_update()

    def fingerprint(self) -> dict[str, str]:
        """The digest all instances agree on; `IntegrityError` naming those that differ."""
        prints = self.map(lambda c, _: (c, c.fingerprint()))
        odd = [repr(c) for c, p in prints if p != prints[0][1]]
        if odd:
            raise IntegrityError(f"instances {odd} hold different weights from "
                                 f"{prints[0][0]!r}")
        return prints[0][1]

    def summary(self, weight_version: str | None, dropped: Sequence[str] = ()) -> str:
        """One line about the fleet after an update: instances, the version, dropped ones."""
        line = f"fleet: {len(self.clients)} instance(s) at {weight_version!r}"
        if dropped:
            line += f"; dropped {', '.join(dropped)}"
        return line

    def close(self) -> None:
        """Stop the worker threads."""
        self._pool.shutdown(wait=False)
        for queue in self._queues.values():
            queue.close()

    def __repr__(self) -> str:
        return f"FanoutClient({self.clients!r}, on_failure={self.on_failure!r})"


PRUNE_WAIT_S = 10.0
"""How long `FanoutClient.prune` waits for an instance's answer before dropping it."""
class FleetFinish:
    """A fleet's finish issued behind its update calls (a `PendingCall`): its two phases run
    on the thread that settles it, once the calls before it are answered (no second thread
    waits on the same calls)."""

    def __init__(self, fanout: FanoutClient, after: PendingCall | None,
                 weight_version: str | None) -> None:
        self.fanout = fanout
        self.after = after
        self.weight_version = weight_version
        self._ran = False
        self._failure: BaseException | None = None

    def _run(self) -> None:
        self._ran = True
        try:
            self.fanout.finish_weight_update(self.weight_version)
        except BaseException as exc:
            self._failure = exc

    def done(self) -> bool:
        """Whether the finish ran: it runs here, once the calls before it are answered
        (their data moved: the finish itself is short)."""
        if not self._ran and (self.after is None or self.after.done()):
            try:
                if self.after is not None:
                    self.after.result(0)
            except BaseException as exc:  # (the call before failed: no finish)
                self._ran, self._failure = True, LifecycleError(
                    f"finish_weight_update skipped: the call before it failed ({exc})")
            else:
                self._run()
        return self._ran

    def result(self, timeout_s: float, spin_from: float | None = None) -> None:
        """Wait for the calls before it (up to `timeout_s`), run both phases, raise their
        failure."""
        if not self._ran:
            if self.after is not None:
                try:
                    self.after.result(timeout_s, spin_from)
                except BaseException as exc:
                    self._ran, self._failure = True, LifecycleError(
                        f"finish_weight_update skipped: the call before it failed ({exc})")
            if not self._ran:
                self._run()
        if self._failure is not None:
            raise self._failure

    def cancel(self) -> None:
        """Never run."""
        self._ran = True


class FanoutCall:
    """One call issued on every instance of a `FanoutClient` (a `PendingCall`)."""

    def __init__(self, fanout: FanoutClient,
                 calls: list[tuple[WeightSyncClient, PendingCall]]) -> None:
        self.fanout = fanout
        self.calls = calls
        self.generation = fanout.generation
        """The fleet's membership when issued: once it changed (an instance dropped), this
        call's failures no longer change it."""

    def of(self, client: WeightSyncClient) -> PendingCall | None:
        """This call's part on `client` (None: it was not issued there)."""
        return next((call for c, call in self.calls if c is client), None)

    def done(self) -> bool:
        """Whether every instance answered, or (all or nothing) one failed; never blocks."""
        live = [call for client, call in self.calls if client in self.fanout.clients]
        finished = [call for call in live if call.done()]
        if len(finished) == len(live) or self.fanout.on_failure == "drop":
            return len(finished) == len(live)
        for call in finished:
            try:
                call.result(0)
            except Exception:
                return True
        return False

    def result(self, timeout_s: float, spin_from: float | None = None) -> None:
        """Wait up to `timeout_s` for every instance; failures as `FanoutClient.settle`
        says."""
        deadline = time.monotonic() + timeout_s
        failures: list[tuple[WeightSyncClient, BaseException]] = []
        for client, call in self.calls:
            if client not in self.fanout.clients:
                continue  # dropped by an earlier call
            try:
                call.result(max(0.0, deadline - time.monotonic()), spin_from)
            except Exception as exc:
                failures.append((client, exc))
        if failures and self.generation != self.fanout.generation:
            raise self.fanout.failed(failures, len(self.calls))  # (a stale call)
        self.fanout.settle(failures, len(self.calls))

    def cancel(self) -> None:
        """Stop waiting on every instance."""
        for _, call in self.calls:
            call.cancel()


def _error_fields(response: Any) -> dict[str, str]:
    """``{"type", "message"}`` of an error reply: ours (``{"error", "message"}``), or another
    server's (``{"error": text}``, FastAPI's ``{"detail": ...}``, plain text; typed by the
    wtransfer error its text relays, if any)."""
    try:
        body = response.json()
    except ValueError:
        return {"type": "HTTPError", "message": response.text[:500]}
    if isinstance(body, dict) and "message" in body and isinstance(body.get("error"), str):
        return {"type": body["error"], "message": str(body["message"])}
    if isinstance(body, dict) and ("error" in body or "detail" in body):
        message = str(body.get("error", body.get("detail")))
    else:
        message = str(body)[:500]
    return {"type": relayed_kind(message) or "HTTPError", "message": message}


def http_session(base_url: str, **options: Any) -> Any:
    """An `httpx.Client` for `base_url` whose idle connections expire before a server's."""
    httpx = _httpx()
    limits = httpx.Limits(max_connections=options.pop("max_connections", 100),
                          keepalive_expiry=CLIENT_KEEPALIVE_S)
    return httpx.Client(base_url=base_url, limits=limits, **options)


def _httpx() -> Any:
    try:
        import httpx
    except ImportError:
        raise ConfigError("http_session needs httpx: from the clone, "
                          "pip install -e '.[serve]'") from None
    return httpx


class HTTPClient(SingleEngineClient):
    """A `WeightSyncClient` plus pause/resume/version/generate calls for `wtransfer serve`."""

    def __init__(self, base_url: str, api_key: str | None = None, *,
                 timeout_s: float = 60.0) -> None:
        if not timeout_s > 0:
            raise ConfigError(f"timeout_s must be a positive number of seconds, got {timeout_s}")
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        if api_key is not None and (not api_key.isprintable() or not api_key.isascii()):
            raise ConfigError("api_key must be printable ASCII (it travels in a header)")
        self._http = HTTPConnections(
            self.base_url, timeout_s=timeout_s,
            headers={"Authorization": f"Bearer {api_key}"} if api_key else {})

    def _request(self, method: str, path: str, *, json_body: Any = None, packed: Any = None,
                 params: dict[str, str] | None = None) -> Any:
        body, headers = None, {}
        if packed is not None:
            body, headers = wire.encode(packed), {"Content-Type": "application/msgpack"}
        elif json_body is not None:
            try:
                body = json.dumps(json_body, allow_nan=False).encode()
            except (TypeError, ValueError) as exc:
                raise ConfigError(f"{method} {path}: the body is not valid JSON: {exc}") from None
            headers = {"Content-Type": "application/json"}
        with self._reaching(method, path):
            response = self._http.request(method, path, body=body, headers=headers,
                                          params=params)
        if response.status >= 400:
            raise from_reply(_error_fields(response), f"{method} {path} -> "
                                                      f"{response.status}")
        if not response.content:
            return None
        if "json" in response.content_type:
            return response.json()
        return response.text  # a plain-text answer (vLLM's adapter routes give one)

    @contextlib.contextmanager
    def _reaching(self, method: str, path: str) -> Iterator[None]:
        """The connection's failures as ours: no answer in time, `TransferTimeout`; a server
        that cannot be reached or drops the connection, `PeerError`."""
        where = f"{method} {self.base_url}{path}"
        try:
            yield
        except WTransferError:
            raise
        except TimeoutError:
            raise TransferTimeout(f"{where}: no answer within {self.timeout_s:g}s") from None
        except (OSError, http.client.HTTPException) as exc:
            raise PeerError(f"{where}: cannot reach the server: {type(exc).__name__}: "
                            f"{exc}") from None

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """POST /init_weight_transfer_engine."""
        self._request("POST", "/init_weight_transfer_engine", packed={"init_info": init_info})

    def start_weight_update(self) -> None:
        """POST /start_weight_update."""
        self._request("POST", "/start_weight_update")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """POST /update_weights (msgpack body)."""
        self._request("POST", "/update_weights", packed={"update_info": update_info})

    def push_weights(self, address: str, backend: str, init_fields: dict[str, Any]
                     ) -> dict[str, Any]:
        """POST /push_weights: the server sends its live weights to the receiver served at
        `address` (an instance joining from it); their version and fingerprint."""
        return dict(self._request("POST", "/push_weights", json_body={
            "address": address, "backend": backend, "init_fields": init_fields}))

    def stage_weight_update(self) -> None:
        """POST /stage_weight_update."""
        self._request("POST", "/stage_weight_update")

    def discard_weight_update(self, reason: str) -> None:
        """POST /discard_weight_update."""
        self._request("POST", "/discard_weight_update", json_body={"reason": reason})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """POST /finish_weight_update."""
        self._request("POST", "/finish_weight_update", json_body={"weight_version": weight_version})

    def can_batch(self, method: str) -> bool:
        """Whether `method` may travel in a ``POST /weight_calls`` batch (`CallQueue` sends
        the calls that wait together in one)."""
        return method in BATCHED_CALLS

    def call_batch(self, calls: Sequence[BatchedCall]) -> Iterator[BaseException | None]:
        """POST /weight_calls (msgpack; each call's own body inside): the engine runs `calls`
        in order, each only if its `after` succeeded, and streams each answer as it comes;
        yields each call's failure (None: it succeeded). A server without the route (404,
        405), or a batch over `MAX_BATCH_BYTES` or `MAX_BATCHED_CALLS` (or its 413), is
        `BatchRefused`: nothing ran."""
        if len(calls) > MAX_BATCHED_CALLS:
            raise BatchRefused(f"{len(calls)} calls in one batch", lasting=False)
        body = wire.encode({"calls": [record_to_wire(WeightCall(
            method=c.method, body=wire.encode(c.args) if c.args else b"", after=c.after))
            for c in calls]})
        if len(body) > MAX_BATCH_BYTES:
            raise BatchRefused(f"{len(body)} bytes in one batch", lasting=False)
        lines = self._http.lines("POST", "/weight_calls", body=body,
                                 headers={"Content-Type": "application/msgpack"})
        where = f"POST {self.base_url}/weight_calls"
        with contextlib.closing(lines), self._reaching("POST", "/weight_calls"):
            try:
                for index, line in enumerate(lines):  # (to the end: the connection is reused)
                    if index >= len(calls):
                        raise PeerError(f"{where}: more answers than the {len(calls)} calls")
                    try:
                        answer = json.loads(line)
                    except ValueError as exc:
                        raise PeerError(f"{where}: an answer is not JSON: {exc}") from None
                    outcome = parse_record(CallOutcome, answer, where="a call's answer",
                                           error=PeerError)
                    yield None if outcome.status < 400 else from_reply(
                        {"type": outcome.error, "message": outcome.message},
                        f"POST /{calls[index].method} -> {outcome.status}")
            except HTTPStatusError as exc:
                status = exc.reply.status
                if status in (404, 405, 413):  # (the route answered before any call ran)
                    raise BatchRefused(f"{where} -> {status}", lasting=status != 413) from None
                raise from_reply(_error_fields(exc.reply), f"{where} -> {status}") from None

    def fingerprint(self) -> dict[str, str]:
        """GET /weight_fingerprint."""
        return dict(self._request("GET", "/weight_fingerprint")["fingerprint"])

    def num_workers(self) -> int:
        """Receiving workers behind the server (its data-parallel ranks), from /weight_info."""
        return check_workers(self, self._request("GET", "/weight_info").get("num_workers"))

    def pause(self, mode: PauseMode = "abort", clear_cache: bool = True) -> None:
        """POST /pause."""
        self._request("POST", "/pause", params={"mode": check_pause_mode(mode),
                                                "clear_cache": str(clear_cache).lower()})

    def resume(self) -> None:
        """POST /resume."""
        self._request("POST", "/resume")

    def is_paused(self) -> bool:
        """GET /is_paused."""
        return bool(self._request("GET", "/is_paused")["is_paused"])

    def update_weight_version(self, new_version: str) -> None:
        """POST /update_weight_version."""
        self._request("POST", "/update_weight_version", json_body={"new_version": new_version})

    def get_weight_version(self) -> str:
        """GET /weight_info."""
        return str(self._request("GET", "/weight_info")["weight_version"])

    def generate(self, token_ids: list[int], **sampling: Any) -> dict[str, Any]:
        """POST /inference/v1/generate (non-streaming); returns the response body."""
        return dict(self._request("POST", "/inference/v1/generate",
                                  json_body={"token_ids": token_ids,
                                             "sampling_params": sampling}))

    def close(self) -> None:
        """Close the idle connections."""
        self._http.close()

    def __repr__(self) -> str:
        return f"HTTPClient({self.base_url!r})"
