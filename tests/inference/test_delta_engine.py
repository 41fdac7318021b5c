"""Delta updates into our inference engine: staged (swap, copy) and in place, whole and
tensor-parallel (each worker applies the changed elements inside its own shard), bit-exact
after many steps; a rollback of the engine's weights makes the next update full."""

import asyncio

import pytest
from engine_helpers import run
from wtransfer_ipc import IPCTrainerInitInfo
from wtransfer_nccl import NCCLTrainerInitInfo

import wtransfer
from wtransfer.errors import ConfigError
from wtransfer.inference import AsyncEngine, EngineConfig, LocalEngineClient
from wtransfer.inference.model.decoder import load_model
from wtransfer.shapes import perturb


def info(backend, workers):
    if backend == "nccl":
        return NCCLTrainerInitInfo(master_address="127.0.0.1", world_size=1 + workers,
                                   timeout_s=60, bucket_bytes=1 << 16, delta=True)
    return IPCTrainerInitInfo(bucket_bytes=1 << 16, timeout_s=60, delta=True)


@pytest.mark.parametrize(("staging", "tp", "backend"), [
    ("swap", 1, "ipc"), ("copy", 1, "nccl"), ("off", 2, "nccl"), ("swap", 2, "ipc")])
def test_delta_updates_land_bit_exact_in_every_engine_layout(staging, tp, backend):
    """12 updates of ~1% changed elements after a full one: each moves a small fraction of the
    bytes and the engine's weights (every worker's shard) equal the trainer's after each; with
    swap staging, a rollback between two deltas makes the next update full, then deltas go
    on."""
    async def main():
        engine = AsyncEngine(EngineConfig(model="tiny", tensor_parallel_size=tp,
                                          update_staging=staging, update_rollback=False,
                                          weight_transfer_backend=backend))
        trainer = load_model("tiny", seed=3)
        client = LocalEngineClient(engine)
        sender = await asyncio.to_thread(wtransfer.trainer_init, info(backend, tp),
                                         client=client, source=wtransfer.ModuleSource(trainer))
        try:
            first = await asyncio.to_thread(sender.send_weights, "0")
            assert first.wire_bytes == first.bytes
            for step in range(1, 13):
                perturb(trainer, 0.01, seed=step)
                if step == 7 and staging == "swap":
                    await engine.rollback_weights()
                    previous = load_model("tiny", seed=3)
                    for back in range(1, 6):  # the trainer follows the engine back one step
                        perturb(previous, 0.01, seed=back)
                    assert await engine.fingerprint() == wtransfer.fingerprint(
                        previous.state_dict())
                stats = await asyncio.to_thread(sender.send_weights, str(step))
                if step == 7 and staging == "swap":
                    assert stats.wire_bytes == stats.bytes  # the engine's base was gone
                else:
                    assert stats.wire_bytes < stats.bytes / 10, step
                assert await engine.fingerprint() == wtransfer.fingerprint(
                    trainer.state_dict()), step
            assert await engine.get_weight_version() == "12"
        finally:
            await asyncio.to_thread(sender.shutdown)
            engine.shutdown()

    run(main(), deadline_s=300)


def dense_then_sparse(source_of, dense_steps: int, steps: int) -> list[tuple[str, bool]]:
    """Updates of a tiny model into an engine: every element changed for `dense_steps` steps
    (a float32 model under a large learning rate), then 1% of them; per update whether it went
    as a delta and whether the sender then held a last-sent copy. The engine holds the
    trainer's weights after every update."""
    from wtransfer.shapes import randomize

    async def main():
        engine = AsyncEngine(EngineConfig(model="tiny", update_staging="swap"))
        trainer = load_model("tiny", seed=3)
        sender = await asyncio.to_thread(wtransfer.trainer_init, info("ipc", 1),
                                         client=LocalEngineClient(engine),
                                         source=source_of(trainer))
        seen = []
        try:
            for step in range(steps):
                if step >= dense_steps:
                    perturb(trainer, 0.01, seed=step)
                else:
                    randomize(trainer, seed=100 + step)
                stats = await asyncio.to_thread(sender.send_weights, str(step))
                seen.append(("delta" if stats.changed_fraction is not None else "full",
                             stats.delta_base_bytes > 0))
                assert await engine.fingerprint() == wtransfer.fingerprint(
                    trainer.state_dict()), step
        finally:
            await asyncio.to_thread(sender.shutdown)
            engine.shutdown()
        return seen

    return run(main(), deadline_s=300)


def test_a_sender_predicts_dense_deltas_from_a_sample_and_sends_in_full_runs():
    """Every element changes: the sample says so before any delta is computed, and the
    sender sends FULL_RUN updates in full without a copy; the probe after the run (against a
    sample its last update kept) says dense again, and the next run is twice as long; once
    changes are sparse the probe goes in full with a copy, and deltas go on."""
    from wtransfer.trainer.deltas import FULL_RUN

    dense = 1 + FULL_RUN + 2 * FULL_RUN  # the first update, then two runs
    seen = dense_then_sparse(wtransfer.ModuleSource, dense, dense + 3)
    assert seen == ([("full", True)] + [("full", False)] * (3 * FULL_RUN)
                    + [("full", True), ("delta", True), ("delta", True)]), seen


class UnheldSource(wtransfer.ModuleSource):
    """A source that cannot offer its tensors again (as a generator's): no sample to probe."""

    def held(self):
        return None


def test_a_sender_whose_deltas_stay_dense_sends_in_full_then_probes_again():
    """Where the source cannot offer its tensors for a sample: after DENSE_STREAK dense
    deltas the sender stops comparing and keeps no copy for FULL_RUN updates, then probes
    with a delta (one dense probe starts another run); once changes are sparse it stays on
    deltas."""
    from wtransfer.trainer.deltas import DENSE_STREAK, FULL_RUN

    dense = 1 + DENSE_STREAK + 2 * FULL_RUN + 1  # the second probe sees sparse changes
    seen = dense_then_sparse(UnheldSource, dense, 1 + DENSE_STREAK + 2 * (FULL_RUN + 1) + 2)
    run = [("full", False)] * (FULL_RUN - 1) + [("full", True)]
    assert seen == ([("full", True)] + [("delta", True)] * DENSE_STREAK + run
                    + [("delta", True)] + run  # one dense probe: another run
                    + [("delta", True)] * 3), seen


def test_the_last_sent_copy_lives_where_delta_copy_device_says():
    with pytest.raises(ConfigError, match="delta_copy_device must be 'cpu' or a CUDA device"):
        IPCTrainerInitInfo(delta=True, delta_copy_device="tpu")
    with pytest.raises(ConfigError, match="delta_copy_device must be 'cpu' or a CUDA device"):
        IPCTrainerInitInfo(delta=True, delta_copy_device="meta")


@pytest.mark.gpu
def test_a_last_sent_copy_on_the_gpu_diffs_there_and_lands_bit_exact():
    """delta_copy_device="cuda:0" holds the copy (one model's size) in device memory, where
    "cpu" does not; either way the deltas after the first update stay small and the engine
    holds the trainer's weights."""
    import torch

    async def grown(copy_device):
        engine = AsyncEngine(EngineConfig(model="tiny", device="cuda:0", update_staging="swap"))
        trainer = load_model("tiny", seed=3, device="cuda:0")
        sender = await asyncio.to_thread(
            wtransfer.trainer_init, IPCTrainerInitInfo(bucket_bytes=1 << 16, timeout_s=60,
                                                       delta=True, delta_copy_device=copy_device),
            client=LocalEngineClient(engine), source=wtransfer.ModuleSource(trainer))
        try:
            before = torch.cuda.memory_allocated(0)
            for step in range(4):
                if step:
                    perturb(trainer, 0.01, seed=step)
                stats = await asyncio.to_thread(sender.send_weights, str(step))
                if step:
                    assert stats.wire_bytes < stats.bytes / 10, step
                else:  # (the full update that took the copy: the same work either way)
                    grew = torch.cuda.memory_allocated(0) - before
                assert await engine.fingerprint() == wtransfer.fingerprint(trainer.state_dict())
            return grew, stats.delta_base_bytes
        finally:
            await asyncio.to_thread(sender.shutdown)
            engine.shutdown()

    async def main():
        on_gpu, copy_bytes = await grown("cuda:0")
        on_host, _ = await grown("cpu")
        assert on_gpu - on_host >= copy_bytes > 0

    run(main(), deadline_s=240)
