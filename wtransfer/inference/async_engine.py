"""`AsyncEngine`, the asyncio front end of the inference engine, and `LocalEngineClient`, the
blocking `WeightSyncClient` a trainer in the same process drives it with."""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import AsyncGenerator, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

import torch

from wtransfer.control.clients import SingleEngineClient
from wtransfer.control.rpc import ReceiverServer
from wtransfer.errors import ConfigError, TransferTimeout
from wtransfer.inference.commands import TRANSFER_COMMANDS, Chained, CoreClient, chained
from wtransfer.inference.config import EngineConfig
from wtransfer.inference.engine_core import EngineCore
from wtransfer.inference.outputs import OutputSnapshot, RequestOutput
from wtransfer.inference.params import SamplingParams
from wtransfer.records import PauseMode, check_pause_mode
from wtransfer.registry import get_backend


def check_runtime(config: EngineConfig) -> None:
    """What `EngineConfig` cannot check without torch or the registry, checked before any
    process starts: the weight-transfer backend exists, and the device is there."""
    get_backend(config.weight_transfer_backend)
    device = config.device
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError(f"device {device!r} needs a CUDA GPU, but torch sees none "
                              "(a CPU-only torch build, or CUDA_VISIBLE_DEVICES hides them); "
                              "use device 'cpu'")
        index = device.partition(":")[2]
        if index and not (index.isdigit() and int(index) < torch.cuda.device_count()):
            raise ConfigError(f"device {device!r}: torch sees {torch.cuda.device_count()} "
                              "GPU(s)")
    elif device != "cpu":
        raise ConfigError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")


@dataclass(frozen=True)
class Prefilled:
    """What a prefill instance computed for a request: its first token and logprob, the
    weight version, and the prompt's K/V per layer (None: the hand-over failed)."""

    token: int
    logprob: float
    version: str
    kv: list[tuple[torch.Tensor, torch.Tensor]] | None


class AsyncEngine:
    """Generate with `generate()`; pause, update weights and resume while requests are live.

    Every call is forwarded to the engine core's thread and handled between two steps.
    """

    def __init__(self, config: EngineConfig | None = None) -> None:
        self.config = config or EngineConfig()
        check_runtime(self.config)
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop,
                                       asyncio.Queue[RequestOutput | OutputSnapshot]]] = {}
        self._held: dict[asyncio.AbstractEventLoop, list[tuple[
            asyncio.Queue[RequestOutput | OutputSnapshot], RequestOutput | OutputSnapshot]]] = {}
        """Outputs emitted by the engine's thread, not yet delivered (`_emit`)."""
        self._held_lock = threading.Lock()
        self.core: CoreClient
        if self.config.data_parallel_size > 1:
            from wtransfer.inference.dp.frontend import DataParallelCore

            self.core = DataParallelCore(self.config, self._emit)
        else:
            self.core = EngineCore(self.config, self._emit)
        self._servers: list[ReceiverServer] = []

    def _emit(self, output: RequestOutput | OutputSnapshot) -> None:
        """Hand `output` to its stream's event loop. A step's outputs travel together: the
        first one held for a loop schedules one delivery of all of them (a wake-up per
        output cost the engine's thread a syscall each and the loop a callback each)."""
        stream = self._streams.get(output.request_id)
        if stream is None:
            return
        loop, queue = stream
        if loop.is_closed():  # (nobody reads this stream any more)
            with self._held_lock:
                self._held.pop(loop, None)
            return
        with self._held_lock:
            held = self._held.setdefault(loop, [])
            held.append((queue, output))
            if len(held) > 1:
                return
        try:
            loop.call_soon_threadsafe(self._deliver, loop)
        except RuntimeError:  # (the loop is closed: nobody reads these any more)
            with self._held_lock:
                self._held.pop(loop, None)

    def _deliver(self, loop: asyncio.AbstractEventLoop) -> None:
        """Put every output held for `loop` into its stream's queue, in order (snapshots
        unbuilt: `generate` builds those it yields)."""
        with self._held_lock:
            held = self._held.pop(loop, [])
        for queue, output in held:
            queue.put_nowait(output)

    def num_workers(self) -> int:
        """Receiving workers behind this engine (its data-parallel ranks times their
        tensor-parallel workers); a trainer sizes NCCL groups and UCX endpoint counts by it."""
        return self.config.data_parallel_size * self.config.tensor_parallel_size

    def call(self, command: str, *args: Any) -> Any:
        """Run one of `COMMANDS` from a thread other than this engine's event loop and wait
        for it (the blocking face, used by `LocalEngineClient` and the RPC server)."""
        timeout = self.config.call_timeout_s
        try:
            return self.core.submit(command, *args).result(timeout=timeout)
        except FutureTimeout:
            raise TransferTimeout(f"{command} did not complete within {timeout:g}s") from None

    async def _call(self, command: str, *args: Any, timeout: float | None = None) -> Any:
        future = self.core.submit(command, *args)
        timeout = timeout or self.config.call_timeout_s
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), timeout)
        except asyncio.TimeoutError:
            raise TransferTimeout(f"{command} did not complete within {timeout:g}s") from None

    async def generate(self, prompt_token_ids: list[int], sampling_params: SamplingParams | None
                       = None, request_id: str | None = None, *, capture_kv: bool = False,
                       prefilled: Prefilled | None = None
                       ) -> AsyncGenerator[RequestOutput, None]:
        """Stream cumulative outputs of one request; leaving early aborts it; a slow reader gets the
        latest output in place of those it missed. A `request_id` still running (or not yet
        aborted) is a `ConfigError`. `capture_kv` keeps the prompt's K/V for a decode instance;
        `prefilled` decodes from a prefill's K/V when versions match (`Replica.add_prefilled`)."""
        rid = request_id or uuid.uuid4().hex
        queue: asyncio.Queue[RequestOutput | OutputSnapshot] = asyncio.Queue()
        stream = (asyncio.get_running_loop(), queue)
        if self._streams.setdefault(rid, stream) is not stream:  # atomic check-and-claim
            raise ConfigError(f"request id {rid!r} is already running; use a unique id")
        added = finished = False
        try:
            params = sampling_params or SamplingParams()
            if prefilled is not None:
                await self._call("add_prefilled", rid, list(prompt_token_ids), params,
                                 prefilled.token, prefilled.logprob, prefilled.version,
                                 prefilled.kv)
            elif capture_kv:
                await self._call("add_request", rid, list(prompt_token_ids), params, True)
            else:
                await self._call("add_request", rid, list(prompt_token_ids), params)
            added = True
            while not finished:
                waiting = [await queue.get()]
                while not queue.empty():  # (the engine went on while this request's reader
                    waiting.append(queue.get_nowait())  # was away)
                for output in _merged(waiting):
                    finished = output.finished
                    yield output
        finally:
            if added and not finished:  # the id stays taken until the abort ran: outputs it
                self._release_after_abort(rid, stream)  # makes are not a new request's
            else:
                self._streams.pop(rid, None)

    def _release_after_abort(self, rid: str,
                             stream: tuple[asyncio.AbstractEventLoop, Any]) -> None:
        """Abort request `rid`, whose reader left, and free its id once the engine ran the
        abort (every output of it is emitted by then, to the reader that left)."""
        def release(_: Future[Any]) -> None:
            if self._streams.get(rid) is stream:
                self._streams.pop(rid, None)

        try:
            self.core.submit("abort", [rid]).add_done_callback(release)
        except Exception:  # (the engine is gone: nothing will emit for it)
            release(Future())
            raise

    async def take_captured(self, request_id: str) -> dict[str, Any] | None:
        """The prompt K/V, first token and version kept for a `capture_kv` request, once."""
        captured = await self._call("take_captured", request_id)
        return None if captured is None else dict(captured)

    async def abort_requests(self, request_ids: list[str] | None = None) -> int:
        """Abort the given requests (all when None); returns how many were live."""
        return int(await self._call("abort", request_ids))

    async def pause_generation(self, mode: PauseMode = "abort", clear_cache: bool = True) -> None:
        """Pause: "abort" ends live requests, "wait" lets them finish first, "keep" freezes
        them to continue after resume. New requests wait until `resume_generation`."""
        held: Future[None] = await self._call("pause", mode, clear_cache,
                                              timeout=self.config.step_timeout_s)
        try:
            await asyncio.wait_for(asyncio.wrap_future(held), self.config.step_timeout_s)
        except asyncio.TimeoutError:
            raise TransferTimeout(f"running requests did not finish within "
                                  f"{self.config.step_timeout_s}s of a wait-mode pause") from None

    async def resume_generation(self) -> None:
        """Resume (a no-op when not paused)."""
        await self._call("resume", timeout=self.config.step_timeout_s)

    async def is_paused(self) -> bool:
        """Whether a pause is in effect."""
        return bool(await self._call("is_paused"))

    async def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """Create and initialize the receiver of the configured backend."""
        await self._call("init_weight_transfer_engine", init_info)

    def run_calls(self, calls: Sequence[Chained]) -> AsyncGenerator[BaseException | None, None]:
        """Run weight-sync `calls` in order, each submitted as the one before it completes and
        only if its `after` succeeded (`commands.chained`: an engine that runs its updates
        on its own thread runs them all between the same two steps); yields each call's
        failure (None: it succeeded) as it completes."""
        for command, _, _ in calls:
            if command not in TRANSFER_COMMANDS:
                raise ConfigError(f"{command} is not a weight-sync call")
        return chained(self.core.submit, calls, self.config.call_timeout_s)

    async def start_weight_update(self) -> None:
        """Open a weight update (in place: the engine must be paused or idle; staged: while
        it generates)."""
        await self._call("start_weight_update")

    async def update_weights(self, update_info: dict[str, Any]) -> None:
        """Receive one part of the update."""
        await self._call("update_weights", update_info)

    async def stage_weight_update(self) -> None:
        """Check the open update on every rank without making it live (a fleet's first
        phase; `finish_weight_update` then commits it)."""
        await self._call("stage_weight_update")

    async def discard_weight_update(self, reason: str) -> None:
        """Fail the open update on purpose: nothing of it goes live."""
        await self._call("discard_weight_update", reason)

    async def finish_weight_update(self, weight_version: str | None = None) -> None:
        """Complete the update; `weight_version` labels the tokens produced from now on (a
        staged update returns once its commit made the new weights live)."""
        await self._call("finish_weight_update", weight_version)

    async def push_weights(self, address: str, backend: str, init_fields: dict[str, Any]
                           ) -> dict[str, Any]:
        """Send the live weights to the receiver at `address` (a joining instance); their
        version and fingerprint (`Replica.push_weights`)."""
        return dict(await self._call("push_weights", address, backend, init_fields))

    async def rollback_weights(self) -> None:
        """Swap the previous weight version back in, with its label (staged swap updates:
        possible once after a commit, until the next update starts); requests in flight are
        re-prefilled with it."""
        await self._call("rollback_weights")

    async def update_weight_version(self, version: str) -> None:
        """Relabel the current weights."""
        await self._call("update_weight_version", version)

    async def get_weight_version(self) -> str:
        """The current weight label ("default" until the first update)."""
        return str(await self._call("get_weight_version"))

    async def fingerprint(self) -> dict[str, str]:
        """Per-tensor digest of the served weights."""
        return dict(await self._call("fingerprint"))

    async def weight_info(self, timeout: float | None = None) -> dict[str, Any]:
        """Version, update state, and whether a failed update left the weights torn."""
        return dict(await self._call("weight_info", timeout=timeout))

    def failure(self) -> str | None:
        """Why the engine cannot serve any more (its loop or a data-parallel rank died), or
        None; once set, every call raises `EngineDeadError`."""
        return self.core.failure()

    async def stats(self) -> dict[str, Any]:
        """Engine counters."""
        return dict(await self._call("stats"))

    def serve_rpc(self, address: str = "tcp://127.0.0.1:0") -> str:
        """Serve the weight-sync calls at `address` for an `RPCClient`; returns the address."""
        server = ReceiverServer(LocalEngineClient(self), address).start()
        self._servers.append(server)
        return server.address

    def stop_rpc(self, address: str) -> None:
        """Stop serving the weight-sync calls at `address` (from `serve_rpc`)."""
        for server in [s for s in self._servers if s.address == address]:
            server.close()
            self._servers.remove(server)

    def shutdown(self) -> None:
        """Stop serving, abort live requests, stop the engine thread."""
        for server in self._servers:
            server.close()
        self._servers = []
        self.core.shutdown()


class LocalEngineClient(SingleEngineClient):
    """A blocking `WeightSyncClient` over an in-process `AsyncEngine` (every data-parallel
    rank included); call it from any thread but the engine's event loop."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    @property
    def weight_version(self) -> str:
        """The engine's current weight label."""
        return str(self.engine.call("get_weight_version"))

    def num_workers(self) -> int:
        """Receiving workers behind the engine (its data-parallel ranks)."""
        return self.engine.num_workers()

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """Initialize the receiver of every rank."""
        self.engine.call("init_weight_transfer_engine", init_info)

    def start_weight_update(self) -> None:
        """Open an update on every rank."""
        self.engine.call("start_weight_update")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Deliver one part of the update to every rank."""
        self.engine.call("update_weights", update_info)

    def stage_weight_update(self) -> None:
        """Check the open update on every rank, nothing live yet."""
        self.engine.call("stage_weight_update")

    def discard_weight_update(self, reason: str) -> None:
        """Fail the open update on every rank."""
        self.engine.call("discard_weight_update", reason)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """Finish on every rank and relabel the weights."""
        self.engine.call("finish_weight_update", weight_version)

    def fingerprint(self) -> dict[str, str]:
        """Per-tensor digest of the served weights (every rank must agree)."""
        return dict(self.engine.call("fingerprint"))

    def pause(self, mode: PauseMode = "abort", clear_cache: bool = True) -> None:
        """Pause generation (every rank) and wait until the pause holds."""
        held = self.engine.call("pause", check_pause_mode(mode), clear_cache)
        timeout = self.engine.config.step_timeout_s
        try:
            held.result(timeout=timeout)
        except FutureTimeout:
            raise TransferTimeout(f"the pause did not hold within {timeout:g}s") from None

    def resume(self) -> None:
        """Resume generation."""
        self.engine.call("resume")

    def __repr__(self) -> str:
        return f"LocalEngineClient(data_parallel_size={self.engine.num_workers()})"


def _merged(waiting: list[RequestOutput | OutputSnapshot]) -> list[RequestOutput]:
    """The outputs of one request that waited for its reader, in order, built; a snapshot
    followed by another is left out (each is cumulative: the later holds every token of
    the earlier), as when a reader falls behind the engine."""
    return [item.build() if isinstance(item, OutputSnapshot) else item
            for item, after in zip(waiting, [*waiting[1:], None], strict=True)
            if not (isinstance(item, OutputSnapshot) and isinstance(after, OutputSnapshot))]
