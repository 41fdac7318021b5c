"""One model replica's state and logic, without a thread of its own.

`Replica` owns the model, KV cache, scheduler and weight receiver, and implements
`wtransfer.inference.commands.EngineCommands`. Its methods must run on one thread, between
steps: `EngineCore` drives a replica from a thread of its own (the single-process engine); a
data-parallel rank drives one from its process's main loop.
"""

from __future__ import annotations

import contextlib
import logging
import time
from concurrent.futures import Future
from typing import Any

import torch

from wtransfer.errors import ConfigError, EngineDeadError, LifecycleError
from wtransfer.inference.commands import Emit
from wtransfer.inference.config import EngineConfig
from wtransfer.inference.model.decoder import load_model, shard_model
from wtransfer.inference.model.fp8_linear import quantize_model
from wtransfer.inference.model.lora_layers import enable_lora
from wtransfer.inference.model.parallel import (
    ALONE,
    Parallel,
    check_fp8_shardable,
    check_shardable,
    layouts,
    worker_device,
)
from wtransfer.inference.params import SamplingParams
from wtransfer.inference.steps.block_manager import BlockManager
from wtransfer.inference.steps.runner import ModelRunner
from wtransfer.inference.steps.scheduler import PauseState, Scheduler
from wtransfer.inference.steps.sequence import SeqStatus, Sequence
from wtransfer.inference.tp.shard import ShardWeights
from wtransfer.inference.tp.workers import TPWorkers
from wtransfer.inference.updates.lora import AdapterTable, LoRATarget, adapter_fingerprint
from wtransfer.inference.updates.release import return_device_memory
from wtransfer.inference.updates.staging import StagingMode
from wtransfer.inference.updates.stall import StallMeter
from wtransfer.packing import dtype_name
from wtransfer.receiver.engine import ReceiverState, WeightTransferEngine
from wtransfer.records import PauseMode, check_pause_mode, check_version
from wtransfer.wire import parse_record

log = logging.getLogger("wtransfer.engine")


def available_host_memory() -> int:
    """Bytes of host memory the kernel says are available (MemAvailable), 0 when unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


class Replica:
    """Model, KV cache, scheduler and receiver of one engine replica (see the module docstring).
    `emit` receives each request's cumulative output after every step that changed it;
    `worker_index` is this replica's index among the engine's receiving workers (its DP rank)."""

    def __init__(self, config: EngineConfig, emit: Emit, *, worker_index: int = 0) -> None:
        self.config = config
        self.emit = emit
        self.worker_index = worker_index
        tp = config.tensor_parallel_size
        device = worker_device(config, worker_index, 0)
        full = load_model(config.model, device="cpu" if tp > 1 else str(device),
                          dtype=config.dtype, seed=config.seed)
        checkpoint_dtype = dtype_name(full.model.embed_tokens.weight.dtype)
        # what cannot be split is refused before any worker starts (a worker that fails on it
        # would break the group the others are forming, and hide the reason)
        check_shardable(full.config, Parallel(0, tp, config.enable_expert_parallel))
        if config.quantization == "fp8":
            check_fp8_shardable(full.config, tp, expert=config.enable_expert_parallel)
            quantize_model(full)
        self.adapters = AdapterTable(config.max_loras) if config.max_loras else None
        """Which LoRA adapter is in which slot (None: the engine serves none)."""
        self.lora_rows = (enable_lora(full, config.max_loras, config.max_lora_rank,
                                      full.model.embed_tokens.weight.dtype)
                          if config.max_loras else None)
        mode = self._staging_mode(full, device)
        rollback = mode == "off" and self._rollback_enabled(full)
        self.workers: TPWorkers | None = None
        """Ranks 1..N-1 of this replica's tensor-parallel group (None: not split)."""
        self._failures_seen = 0
        """Rank 0's failure count when `settle_failure` last looked."""
        self._rollback_reserved = False
        """Whether `reserve_rollback` holds every rank's rollback ready."""
        par = ALONE
        if tp > 1:
            self.workers = TPWorkers(config, first_worker=worker_index, staging=mode,
                                     rollback=rollback, device=device)
            par = Parallel(0, tp, config.enable_expert_parallel, self.workers.collective)
            meta = {n: t.to("meta") for n, t in full.state_dict().items()}
            self.workers.layouts = [layouts(full.config, Parallel(r, tp, par.expert), meta)
                                    for r in range(tp)]
            self.model = shard_model(full, par).to(device)
        else:
            self.model = full
        self.weights = ShardWeights(self.model, layouts(full.config, par, full.state_dict()),
                                    backend=config.weight_transfer_backend,
                                    device=str(device), worker_index=worker_index,
                                    staging=mode, rollback=rollback,
                                    checkpoint_dtype=checkpoint_dtype
                                    if config.quantization == "fp8" else None,
                                    adapters=self.adapters, lora_rank=config.max_lora_rank)
        """Rank 0's weights, its shadow and its receiver."""
        del full
        self.staging = self.weights.staging
        """The shadow staged updates land in (None: updates land in place, paused)."""
        self.rollback = self.weights.rollback
        """Whether in-place updates keep host copies to restore on failure (decided once, at
        start: `EngineConfig.update_rollback`, or auto; staged updates never touch the live
        weights, so they need none)."""
        self.target = self.weights.live
        self.runner = ModelRunner(self.model, config, before_forward=(
            self.workers.step if self.workers is not None else None),
            lora=(self.lora_rows, self._slot_of) if self.lora_rows is not None else None,
            weights_epoch=self._weights_epoch,
            other_weights=self.staging.other_weights if self.staging is not None else None)
        self.blocks = BlockManager(self.runner.num_blocks, config.block_size,
                                   config.prefix_caching)
        self.scheduler = Scheduler(self.blocks, max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=config.max_num_batched_tokens,
                                   max_model_len=self.model.config.max_position_embeddings)
        self.weight_version = "default"
        self.steps = 0
        self.tokens_generated = 0
        self.stall = StallMeter()
        """How long each update kept the engine from computing (`update_stall_ms`)."""
        self.commit_ms = 0.0
        """How long the last staged commit held the engine thread (the swap or copy itself;
        the re-prefill it asks for is computed by the steps after it)."""
        self._sequences: dict[str, Sequence] = {}
        self._drained: list[tuple[Future[None], bool]] = []
        self.captured: dict[str, dict[str, Any]] = {}
        """Prompt K/V kept for a decode instance (`add_request(capture_kv=True)`), by
        request id, until `take_captured`."""
        self.prefilled = {"remote": 0, "local": 0}
        """Requests prefilled here and (a decode instance's) by a prefill instance."""

    def _weights_epoch(self) -> int:
        """Moves whenever weight storages are exchanged (a swap commit or rollback)."""
        return self.staging.swaps if self.staging is not None else 0

    @property
    def receiver(self) -> WeightTransferEngine[Any, Any] | None:
        """Rank 0's receiver (None before the first init)."""
        return self.weights.receiver

    # -- stepping --------------------------------------------------------------------------

    @property
    def update_open(self) -> bool:
        """Whether a weight update is open (the receiver's state says; no copy is kept here).
        An update whose sender goes silent fails at the receiver's deadline, so it cannot hold
        the engine forever."""
        return self.receiver is not None and self.receiver.state is ReceiverState.UPDATING

    def can_step(self) -> bool:
        """Whether a step would compute anything now (an update in place holds the steps; a
        staged one lands beside them)."""
        return (self.staging is not None or not self.update_open) and self.scheduler.has_work()

    def step(self) -> int:
        """Schedule and compute one step; returns how many sequences it advanced (or ended). A
        failure while computing ends only that step's requests (finish_reason "error", with the
        message); the engine keeps serving the others."""
        started = time.monotonic()
        batch = self.scheduler.schedule()
        if not batch:
            return 0
        try:
            results = self.runner.run(batch)
        except EngineDeadError:
            raise  # a tensor-parallel worker is gone: the engine cannot step any more
        except Exception as exc:
            log.exception("step failed; ending its %d request(s) with finish_reason 'error'",
                          len(batch))
            for seq in batch:
                seq.error = f"{type(exc).__name__}: {exc}"[:1000]
                self._finish(seq, "error")
                self.emit(seq.to_output())
            return len(batch)
        self.steps += 1
        self.stall.step(started, bool(self.scheduler.running))
        for seq, result in zip(batch, results, strict=True):
            if result is None:
                seq.error = (f"the model's logits for this request are not finite (NaN or "
                             f"inf) under weight version {self._version_of(seq)!r}: its "
                             "weights or adapter hold non-finite values")
                self._finish(seq, "error")
                self.emit(seq.to_output())
                continue
            token, logprob = result
            seq.append(token, logprob, self._version_of(seq))
            if seq.capture_kv and len(seq.output) == 1:
                self._capture(seq)
            seq.num_computed = len(seq) - 1
            self.blocks.commit(seq)
            self.tokens_generated += 1
            if seq.finish_reason is not None:
                self._finish(seq)
            self.emit(seq.snapshot())  # (built by whoever reads it, off this loop)
        return len(batch)

    def _finish(self, seq: Sequence, reason: str | None = None) -> None:
        self.scheduler.finish(seq, reason)
        self._sequences.pop(seq.request_id, None)
        self.runner.forget(seq.request_id)

    def resolve_drains(self) -> None:
        """Complete wait-mode pauses once no request runs."""
        if self._drained and not self.scheduler.running:
            for future, clear in self._drained:
                if clear:
                    self.blocks.reset_prefix_cache()
                future.set_result(None)
            self._drained = []

    def fail_everything(self, dead: Exception) -> None:
        """The driver's loop died: every waiting pause fails with `dead`, and every live
        request ends with finish_reason "error" saying so."""
        for future, _ in self._drained:
            if not future.done():
                future.set_exception(dead)
        self._drained = []
        for seq in list(self._sequences.values()):
            seq.finish_reason, seq.error = "error", str(dead)
            seq.status = SeqStatus.FINISHED
            self.emit(seq.to_output())
        self._sequences.clear()

    # -- requests (engine thread) -----------------------------------------------------------

    def add_request(self, request_id: str, prompt: list[int],
                    params: SamplingParams | dict[str, Any], capture_kv: bool = False) -> None:
        """Queue a request (validated here, so errors reach the caller); with `capture_kv`
        its prompt's K/V is kept when its first token is sampled (`take_captured`)."""
        seq = self._new_sequence(request_id, prompt, params)
        seq.capture_kv = capture_kv
        self.scheduler.add(seq)
        self._sequences[request_id] = seq
        self.prefilled["local"] += 1

    def add_prefilled(self, request_id: str, prompt: list[int],
                      params: SamplingParams | dict[str, Any], token: int, logprob: float,
                      version: str, kv: list[tuple[torch.Tensor, torch.Tensor]] | None) -> str:
        """Add a request a prefill instance computed under weight `version` (K/V per layer as
        [prompt tokens, KV heads, head dim], and its first token). Returns "remote" when it decodes
        from that K/V (live weights at that version, and it fits), else "local" (prefilled here)."""
        seq = self._new_sequence(request_id, prompt, params)
        if kv is None or version != self.weight_version or self.workers is not None \
                or not self._write_prompt_kv(seq, kv):
            self.scheduler.add(seq)
            self._sequences[request_id] = seq
            self.prefilled["local"] += 1
            return "local"
        seq.prefilled_by = "remote"
        self._sequences[request_id] = seq
        self.prefilled["remote"] += 1
        seq.append(token, logprob, version)
        self.tokens_generated += 1
        if seq.finish_reason is not None:
            self._finish(seq)
        self.emit(seq.to_output())
        return "remote"

    def _write_prompt_kv(self, seq: Sequence, kv: list[tuple[torch.Tensor, torch.Tensor]]
                         ) -> bool:
        """Give `seq` blocks, write its prompt's K/V into them and run it; False (nothing
        changed) when it cannot run now or the K/V does not fit this cache."""
        cache = self.runner.kv
        n = len(seq.prompt)
        if len(kv) != len(cache) or any(k.shape != (n, *c.shape[1:]) or v.shape != k.shape
                                        for (k, v), (c, _) in zip(kv, cache, strict=True)):
            return False
        if not self.blocks.allocate(seq):
            return False
        if not self.scheduler.admit_prefilled(seq):
            self.blocks.free(seq)
            return False
        start = seq.num_computed  # (blocks the prefix cache held already)
        slots = self.runner.slots_of(seq.block_table, start, n)
        with torch.no_grad():
            for (k_cache, v_cache), (k, v) in zip(cache, kv, strict=True):
                k_cache[slots] = k[start:].to(k_cache.device, k_cache.dtype)
                v_cache[slots] = v[start:].to(v_cache.device, v_cache.dtype)
        seq.num_computed = n
        return True

    def take_captured(self, request_id: str) -> dict[str, Any] | None:
        """The prompt K/V (per layer), first token, logprob and weight version of a request
        queued with `capture_kv`, once; None when there is none."""
        return self.captured.pop(request_id, None)

    def _capture(self, seq: Sequence) -> None:
        """Keep `seq`'s prompt K/V (on the host) with its first token and version."""
        slots = self.runner.slots_of(seq.block_table, 0, len(seq.prompt))
        self.captured[seq.request_id] = {
            "kv": [(k[slots].cpu(), v[slots].cpu()) for k, v in self.runner.kv],
            "token": seq.output[0], "logprob": seq.logprobs[0],
            "version": self._version_of(seq)}

    def _new_sequence(self, request_id: str, prompt: list[int],
                      params: SamplingParams | dict[str, Any]) -> Sequence:
        """A validated sequence (nothing queued yet)."""
        params = parse_record(SamplingParams, params, where="sampling_params")
        vocab = self.model.config.vocab_size
        if not prompt:
            raise ConfigError("prompt_token_ids must not be empty")
        bad = [t for t in prompt if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ConfigError(f"token ids must be ints in [0, {vocab}); got {bad[:5]}")
        if request_id in self._sequences:
            raise ConfigError(f"request id {request_id!r} is already running")
        if params.lora is not None:
            if self.adapters is None:
                raise ConfigError(f"lora {params.lora!r}: this engine serves no adapters; "
                                  "start it with max_loras > 0")
            self.adapters.slot(params.lora)  # an unknown adapter is refused here
        return Sequence(request_id, prompt, params)

    def abort(self, request_ids: list[str] | None) -> int:
        """Finish the given requests (all when None) with finish_reason "abort"."""
        targets = (list(self._sequences.values()) if request_ids is None
                   else [self._sequences[r] for r in request_ids if r in self._sequences])
        for seq in targets:
            self._finish(seq, "abort")
            self.emit(seq.to_output())
        return len(targets)

    # -- pause (engine thread) -------------------------------------------------------------

    def pause(self, mode: PauseMode, clear_cache: bool) -> Future[None]:
        """Apply a pause; the returned future completes when the pause holds (at once unless
        mode is "wait", which first lets running requests finish)."""
        mode = check_pause_mode(mode)
        done: Future[None] = Future()
        if mode == "wait":
            self.scheduler.state = PauseState.PAUSED_NEW
            self._drained.append((done, clear_cache))
            self.resolve_drains()
            return done
        if mode == "abort":
            self.abort(None)
        self.scheduler.state = PauseState.PAUSED_ALL
        if clear_cache:
            self.scheduler.preempt_all()
            self.blocks.reset_prefix_cache()
        done.set_result(None)
        return done

    def resume_refusal(self) -> str | None:
        """Why `resume` would be refused now (None: it would not be)."""
        if self.update_open and self.staging is None:
            return "a weight update is open; finish it before resuming"
        if self.torn and self.receiver is not None:
            return (f"refusing to resume: the last weight update failed after changing some "
                    f"weights ({self.receiver.failure}); complete a new update first")
        return None

    @property
    def torn(self) -> bool:
        """Whether a failed in-place update left the live weights part new, part old (a
        failed staged update never touched them)."""
        return self.receiver is not None and self.receiver.torn

    def resume(self) -> None:
        """Leave the pause; refused while an update is open or the weights are torn."""
        refusal = self.resume_refusal()
        if refusal is not None:
            raise LifecycleError(refusal)
        self.scheduler.state = PauseState.UNPAUSED

    def is_paused(self) -> bool:
        """Whether a pause is in effect."""
        return self.scheduler.state is not PauseState.UNPAUSED

    # -- weight transfer (engine thread) ---------------------------------------------------

    def _on_every_rank(self, command: str, *args: Any) -> None:
        """Run a weight-transfer command on every rank of the group: the workers first (so
        receivers that must meet, such as an NCCL group, are all in it), then rank 0, then
        wait for the workers' answers (a failure here is the one raised)."""
        pending = self.workers.call_all(command, args) if self.workers is not None else None
        try:
            getattr(self.weights, command)(*args)
        except BaseException:
            if pending is not None and self.workers is not None:
                with contextlib.suppress(Exception):  # rank 0's failure is the one to report
                    self.workers.wait(pending, command)
            raise
        if pending is not None and self.workers is not None:
            self.workers.wait(pending, command)

    def _in_step(self, command: str, *args: Any) -> None:
        """`_on_every_rank` for a command of an open update: when it fails the update on one rank
        while another still has it open, it fails there too (rolled back where enabled); the
        first failure is the one raised. (A rank whose post-processing fails after another
        went live is not undone: in place, `finish_weight_update` stages every rank first.)"""
        try:
            self._on_every_rank(command, *args)
        except BaseException:
            if self.workers is not None:
                with contextlib.suppress(Exception):  # the original failure is the one to say
                    self._fail_everywhere_if_one_failed()
            raise

    def settle_failure(self) -> None:
        """On the engine's loop, before it runs commands or steps: an in-place update that rank 0
        failed on its own (its watchdog saw the sender die or go silent) is failed on every worker
        too, so no rank computes rolled back beside another torn."""
        receiver = self.receiver
        if self.workers is None or self.staging is not None or receiver is None \
                or receiver.failures == self._failures_seen:
            return
        seen = receiver.failures
        try:
            self._fail_everywhere_if_one_failed()
        except Exception:  # tried again on the next turn of the loop
            log.exception("could not fail the update on every tensor-parallel worker")
            return
        self._failures_seen = seen

    def _fail_everywhere_if_one_failed(self) -> None:
        """If one rank failed the open update and another still has it open, fail it there."""
        assert self.workers is not None
        ranks = self.workers_info()
        failed = [rank for rank in ranks if rank["update_state"] == ReceiverState.FAILED.value]
        if not failed or all(rank["update_state"] != ReceiverState.UPDATING.value
                             for rank in ranks):
            return
        reason = f"worker {failed[0]['worker']} failed it: {failed[0]['failure']}"
        pending = self.workers.call_all("fail_update", (reason,))
        self.weights.fail_update(reason)
        self.workers.wait(pending, "fail_update")

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """Create (once) every rank's receiver of the configured backend and initialize it."""
        self._on_every_rank("init_weight_transfer_engine", init_info)

    def _model_bytes(self, model: torch.nn.Module) -> int:
        """Bytes of the whole `model` (every worker together)."""
        return sum(t.numel() * t.element_size() for t in model.state_dict().values())

    def _rollback_enabled(self, model: torch.nn.Module) -> bool:
        if self.config.update_rollback is not None:
            return self.config.update_rollback
        # every worker of this engine (one host) saves its own part: the whole model in all
        return self._model_bytes(model) <= available_host_memory() // 2

    def _staging_mode(self, model: torch.nn.Module, device: torch.device) -> StagingMode:
        """`EngineConfig.update_staging`, or auto: swap when one more copy of a worker's
        weights fits in half the free memory of its device; a mode that does not fit is
        refused here."""
        wanted = self.config.update_staging
        need = self._model_bytes(model) // self.config.tensor_parallel_size  # (one worker's)
        free = (torch.cuda.mem_get_info(device)[0] if device.type == "cuda"
                else available_host_memory())
        if wanted is None:
            if free and need <= free // 2:
                return "swap"
            if self.config.max_loras:
                raise ConfigError(f"LoRA adapters need staged updates, but one more copy of "
                                  f"the weights ({need / 1e6:.1f} MB) does not fit half of "
                                  f"{device}'s free {free / 1e6:.1f} MB; ask for "
                                  "update_staging='swap' explicitly, or serve no adapters")
            return "off"
        if wanted != "off" and free and need > free:
            raise ConfigError(f"update_staging={wanted!r} keeps one more copy of the weights "
                              f"({need / 1e6:.1f} MB) but {device} has {free / 1e6:.1f} MB "
                              "free; choose update_staging='off' (updates in place, paused)")
        return wanted  # type: ignore[return-value]

    def start_weight_update(self) -> None:
        """Open an update; in place, refused while requests run unpaused; staged, on the
        transfer lane while the engine generates (into every rank's shadow)."""
        if self.staging is None and not self.is_paused() and self.scheduler.running:
            raise LifecycleError("the engine is generating; pause_generation(...) before "
                                 "start_weight_update, or serve with update_staging='swap' "
                                 "to update while generating")
        self._on_every_rank("start_weight_update")
        self.stall.open()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Receive one part of the update on every rank; a failure closes the update."""
        self._in_step("update_weights", update_info)

    def stage_weight_update(self) -> None:
        """Check the open update on every rank (complete, sound, post-processed) without
        making it live; the finish that follows commits it."""
        self._in_step("stage_weight_update")

    def discard_weight_update(self, reason: str) -> None:
        """Fail the open update on every rank (a fleet's other instance failed it): staged,
        the shadow is dropped; in place, rolled back where enabled."""
        self._on_every_rank("discard_weight_update", reason)
        self.stall.close()

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """Complete an in-place update and, in the same step, relabel the weights (a staged
        update finishes in two halves: `finish_staged`, then `commit_staged`)."""
        if self.staging is not None:
            self.finish_staged(weight_version)
            self.commit_staged(weight_version)
            return
        if weight_version is not None:
            check_version(weight_version)  # before the update closes, not after
        if self.workers is not None and self.update_open:  # every rank's part checked
            self._in_step("stage_weight_update")  # before any goes live
        self._in_step("finish_weight_update", weight_version)
        self._label(weight_version)
        self.stall.close()

    def finish_staged(self, weight_version: str | None) -> None:
        """The transfer lane's half of a staged finish: the label is checked and every tensor
        arrived in every rank's shadow; nothing live changed yet."""
        if weight_version is not None:
            check_version(weight_version)
        self._in_step("finish_weight_update", weight_version)

    def commit_staged(self, weight_version: str | None) -> None:
        """The engine thread's half, between two steps: every rank's shadow goes live (swap
        or copy) at this boundary, the label with it, and (by default) the requests in flight
        are re-prefilled so every later token is computed with the new weights."""
        started = time.perf_counter()
        if self.workers is not None:
            self.workers.sync_done("commit", previous=self.weight_version)
        self.weights.commit(self.weight_version)
        self._label(weight_version, reprefill=True)
        self.commit_ms = (time.perf_counter() - started) * 1e3
        self.stall.close()

    def push_weights(self, address: str, backend: str, init_fields: dict[str, Any]
                     ) -> dict[str, Any]:
        """Send the live weights to the receiver served at `address` over `backend` (its
        trainer init info from `init_fields`), as a trainer would: a new instance joins from
        this one. Runs between updates (staged: on the transfer lane, while generating); the
        version and fingerprint it sent."""
        if self.workers is not None:
            raise ConfigError("an instance with tensor_parallel_size > 1 cannot send its "
                              "weights to a joining one yet; join from an instance with one "
                              "worker")
        if self.update_open:
            raise LifecycleError("an update is open here; join once it finished")
        from wtransfer.control.rpc import RPCClient
        from wtransfer.registry import get_backend, trainer_init
        from wtransfer.trainer.source import ModuleSource

        info = get_backend(backend).sender_class().init_info_cls
        fields: Any = parse_record(info, init_fields, where="push_weights init_fields")
        client = RPCClient(address, timeout_s=fields.timeout_s)
        reading = (self.staging.reading() if self.staging is not None
                   else contextlib.nullcontext())
        try:  # (staged, on the lane: the engine thread moves no weight while this reads them)
            with reading, trainer_init(fields, client=client,
                                       source=ModuleSource(self.model)) as sender:
                sender.send_weights(weight_version=self.weight_version)
                sent = {"weight_version": self.weight_version,
                        "fingerprint": self.fingerprint()}
        finally:
            client.close()
        return sent

    def reserve_rollback(self, *, hold: bool = True) -> None:
        """Hold a rollback ready on every rank of this replica (rank 0 and its TP workers): each has
        a previous version resident and its live weights free; `rollback_weights(reserved=True)` or
        `release_rollback` follows. Where one cannot, nothing is held; `LifecycleError` says why."""
        if self.staging is None:
            raise LifecycleError("rollback_weights needs staged updates "
                                 "(update_staging='swap')")
        if self.update_open:
            raise LifecycleError("an update is staging into the shadow that holds the previous "
                                 "version; finish or fail it first")
        if self.adapters is not None and self.adapters.live:
            raise LifecycleError("rollback_weights with LoRA adapters loaded is not supported "
                                 "yet (their slots would go back, their labels not)")
        if self._rollback_reserved:
            raise LifecycleError("a rollback is already reserved here")
        self.weights.reserve_rollback(hold=hold)  # rank 0 first: then the workers
        refusals: list[str] = []
        try:
            if self.workers is not None:
                refusals = self.workers.reserve_rollback(hold=hold)
        except BaseException:
            self.weights.release_rollback()
            raise
        if refusals:
            self.weights.release_rollback()
            raise LifecycleError(f"no rank rolled back: {'; '.join(refusals)}")
        self._rollback_reserved = True

    def rollback_weights(self, reserved: bool = False) -> None:
        """Swap the previous version back in on every rank (staged swap updates, once after a
        commit until the next update starts), with its label; requests in flight re-prefill.
        `reserved`: after this replica's `reserve_rollback`."""
        if not reserved:
            self.reserve_rollback(hold=False)  # (done within this command)
        elif not self._rollback_reserved:
            raise LifecycleError("rollback_weights(reserved=True) without reserve_rollback")
        assert self.staging is not None
        self._rollback_reserved = False
        previous = self.staging.previous
        if self.workers is not None:
            try:
                self.workers.sync("rollback")  # each rolls back what it reserved
            except BaseException:
                self.weights.release_rollback()
                raise
        try:
            self.weights.rollback_weights(reserved=True)
        except BaseException as exc:
            if self.workers is not None:  # the workers rolled back: the ranks now disagree
                raise EngineDeadError(f"rank 0 failed to roll back after its tensor-parallel "
                                      f"workers did: {exc}") from exc
            raise
        finally:
            if self.workers is not None:
                self.workers.collective.barrier()  # every worker did the same
        self.weight_version = previous or self.weight_version
        self._after_weights_changed()

    def release_rollback(self) -> None:
        """Give up this replica's reservation (another data-parallel rank could not roll
        back); nothing when none is held."""
        if not self._rollback_reserved:
            return
        self._rollback_reserved = False
        try:
            if self.workers is not None:
                self.workers.sync_done("rollback_release")
        finally:
            self.weights.release_rollback()

    def _label(self, weight_version: str | None, *, reprefill: bool = False) -> None:
        """The update landed: label what it changed (the base weights, or only the adapters
        it carried) and, with `reprefill`, re-prefill the requests it affects."""
        adapters = self.adapters.commit(weight_version) if self.adapters is not None else []
        target = self.weights.target
        written = target.take_base_written() if isinstance(target, LoRATarget) else True
        base = not adapters or written
        if base and weight_version is not None:
            self.weight_version = weight_version
        if reprefill:
            self._after_weights_changed(None if base else set(adapters))

    def _version_of(self, seq: Sequence) -> str:
        """The version a token of `seq` is computed with: its adapter's, else the base's."""
        lora = seq.params.lora
        if lora is None or self.adapters is None:
            return self.weight_version
        return self.adapters.live[lora].version

    def _slot_of(self, seq: Sequence) -> int:
        """The adapter slot `seq` runs with (-1: the base model)."""
        return self.adapters.slot(seq.params.lora) if self.adapters is not None else -1

    def _after_weights_changed(self, adapters: set[str] | None = None) -> None:
        """Re-prefill the requests in flight (only those on `adapters`, when given)."""
        if not self.config.update_reprefill:
            return
        if adapters is None:
            self.scheduler.preempt_all()
            self.blocks.reset_prefix_cache()
            return
        for seq in sorted(self.scheduler.running, key=lambda s: s.arrival, reverse=True):
            if seq.params.lora in adapters:
                self.scheduler.preempt(seq)

    def update_weight_version(self, version: str) -> None:
        """Relabel the current weights."""
        self.weight_version = check_version(version)

    def get_weight_version(self) -> str:
        """The current weight label."""
        return self.weight_version

    def fingerprint(self) -> dict[str, str]:
        """Per-tensor digest of the served weights (full tensors, assembled from every rank),
        and of every live LoRA adapter under its wire names (`adapter_fingerprint`)."""
        if self.workers is not None:
            return self.workers.fingerprint(self.model.state_dict())
        digests = self.target.fingerprint()
        if self.adapters is not None:
            digests.update(adapter_fingerprint(self.model, self.adapters))
        return digests

    def keep_workers_alive(self) -> None:
        """Called while the engine idles: tensor-parallel workers hear from rank 0 within
        their deadline (`TPWorkers.keepalive`)."""
        if self.workers is not None:
            self.workers.keepalive()

    def workers_info(self) -> list[dict[str, Any]]:
        """Every rank's update state and bytes (rank 0 first)."""
        if self.workers is None:
            return [self.weights.info()]
        return [self.weights.info(), *self.workers.wait(self.workers.call_all("info", ()),
                                                        "info")]

    def close(self, *, release: bool = True) -> None:
        """Release every rank's receiver and stop the workers; with `release` (nothing runs
        the model any more) give the weights, the shadow and the KV cache back to the device."""
        self.weights.shutdown()
        if self.workers is not None:
            self.workers.close()
        if release:
            self.weights.release()
            self.runner.release()
            return_device_memory(self.runner.device)

    def weight_info(self) -> dict[str, Any]:
        """The weight label, the receiver's update state, and whether a failed update left
        the weights torn (some tensors new, some old) and why."""
        receiver = self.receiver
        return {"weight_version": self.weight_version,
                "update_state": receiver.state.value if receiver else "none",
                "torn": self.torn,
                "failure": receiver.failure if receiver else None,
                "rollback": self.rollback,
                "update_bytes": receiver.update_bytes if receiver else 0,
                "update_staging": self.staging.mode if self.staging else "off",
                "update_stall_ms": self.stall.last_ms,
                "update_commit_ms": self.commit_ms,
                "previous_version": self.staging.previous if self.staging else None,
                "adapters": ({name: a.version for name, a in sorted(self.adapters.live.items())}
                             if self.adapters is not None else {}),
                "workers": self.workers_info()}

    def stats(self) -> dict[str, Any]:
        """Counters for metrics and benchmarks."""
        return {"steps": self.steps, "tokens_generated": self.tokens_generated,
                "running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
                "paused": self.is_paused(), "weight_version": self.weight_version,
                "prefix_cache_hits": self.blocks.hits, "preemptions": self.scheduler.preemptions,
                "last_update_bytes": self.receiver.last_update_bytes if self.receiver else 0,
                "last_update_seconds": self.receiver.last_update_seconds if self.receiver else 0,
                "torn": self.torn,
                "update_stall_ms": self.stall.last_ms,
                "decode_graphs_built": (self.runner.graphs.built
                                        if self.runner.graphs is not None else 0),
                "prefilled_remote": self.prefilled["remote"],
                "prefilled_local": self.prefilled["local"]}
