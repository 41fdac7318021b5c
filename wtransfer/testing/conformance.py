"""The backend conformance suite: subclass `BackendConformance` in a pytest module.

    from wtransfer.testing.conformance import BackendConformance

    class TestMyBackend(BackendConformance):
        backend = "mine"

Every case runs receivers in real child processes (`wtransfer.launch.peer`) and the trainer
in the test process, over the real control plane (`wtransfer.rpc`). Override `init_fields` when
the backend's trainer init info needs more than the wire parameters (e.g. a rendezvous port).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from typing import Any, ClassVar, TypeVar

import pytest

from wtransfer import errors
from wtransfer.control.clients import FanoutClient
from wtransfer.control.rpc import RPCClient
from wtransfer.fingerprint import fingerprint
from wtransfer.launch.processes import ChildProcess, free_port, spawn_receiver, spawn_trainer
from wtransfer.protocol import WeightSyncClient
from wtransfer.receiver.target import ModuleTarget
from wtransfer.records import LEGACY_CAPABILITY_NAMES, Capabilities, TrainerInitInfo
from wtransfer.registry import create_receiver, get_backend, trainer_init
from wtransfer.shapes import build_module, model_metas, randomize
from wtransfer.testing.delta_cases import DeltaCases
from wtransfer.trainer.engine import TrainerTransferEngine
from wtransfer.trainer.source import ModuleSource

MiB = 1 << 20
T = TypeVar("T")


def wait_for(predicate: Callable[[], T], timeout_s: float, what: str,
             interval_s: float = 0.01) -> T:
    """Poll `predicate` (state in another process, which no event reaches) every
    `interval_s` until it returns something true, and return that; fail the test naming
    `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(interval_s)
    return value


class BackendConformance(DeltaCases):
    """What every backend must do; a subclass sets `backend` (and maybe the hooks)."""

    backend: ClassVar[str]
    device: ClassVar[str] = "cpu"
    """Device of the trainer's tensors (and the receivers', unless `receiver_devices`)."""
    receiver_devices: ClassVar[tuple[str, ...]] = ()
    """Devices of the receivers, in turn (e.g. other GPUs than the trainer's)."""
    model: ClassVar[str] = "mixed"
    bucket_bytes: ClassVar[int] = 128 << 10
    """Smaller than the model's largest tensor (512 KiB), so that one is split."""
    timeout_s: ClassVar[float] = 5.0
    workers: ClassVar[int] = 2
    """Receivers in the several-workers case."""

    # -- hooks ------------------------------------------------------------------------------

    def init_fields(self, workers: int) -> dict[str, Any]:
        """Backend-specific trainer init-info fields for `workers` receivers."""
        return {}

    def trainer_info(self, workers: int = 1, **overrides: Any) -> TrainerInitInfo:
        """The trainer init info for a case."""
        cls = get_backend(self.backend).sender_class().init_info_cls
        fields = {"bucket_bytes": self.bucket_bytes, "timeout_s": self.timeout_s,
                  **self.init_fields(workers), **overrides}
        return cls(**fields)

    # -- fixtures -----------------------------------------------------------------------------

    @pytest.fixture
    def procs(self) -> Iterator[ExitStack]:
        """Children started in a case are closed (or killed) when it ends."""
        with ExitStack() as stack:
            yield stack

    def receivers(self, procs: ExitStack, count: int = 1, *, model: str | None = None,
                  seed: int = 2) -> list[ChildProcess]:
        """Start `count` receiver processes."""
        devices = self.receiver_devices or (self.device,)
        return [procs.enter_context(spawn_receiver(self.backend, model=model or self.model,
                                                   seed=seed + i,
                                                   device=devices[i % len(devices)]))
                for i in range(count)]

    def client(self, children: list[ChildProcess]) -> WeightSyncClient:
        """One RPC client, or a fan-out over several."""
        clients = [RPCClient(c.address, timeout_s=self.timeout_s) for c in children]
        return clients[0] if len(clients) == 1 else FanoutClient(clients)

    def trainer_model(self, seed: int = 1) -> Any:
        """The trainer's copy of the model."""
        return build_module(model_metas(self.model), seed, self.device)

    def sender(self, model: Any, client: WeightSyncClient, workers: int = 1,
               **overrides: Any) -> TrainerTransferEngine[Any]:
        """A sender for `model` over `client`."""
        return trainer_init(self.trainer_info(workers, **overrides), client=client,
                            source=ModuleSource(model))

    # -- cases --------------------------------------------------------------------------------

    def test_round_trip_is_bit_exact(self, procs: ExitStack) -> None:
        """A realistic model (hundreds of mixed-dtype tensors, one split) lands bit-exactly."""
        metas = model_metas(self.model)
        assert len(metas) >= 100 and max(m.nbytes for m in metas) > self.bucket_bytes
        assert len({m.dtype for m in metas}) >= 5
        model = self.trainer_model()
        client = self.client(self.receivers(procs))
        assert client.fingerprint() != fingerprint(model.state_dict())
        sender = self.sender(model, client)
        stats = sender.send_weights(weight_version="v1")
        assert client.fingerprint() == fingerprint(model.state_dict())
        assert stats.bytes == sum(m.nbytes for m in metas)
        assert stats.tensors == len(metas) and stats.buckets > 1
        assert isinstance(client, RPCClient)
        status = client.status()
        assert status["state"] == "ready" and status["weight_version"] == "v1"
        sender.shutdown()

    def test_checksummed_round_trip(self, procs: ExitStack) -> None:
        """With per-bucket checksums on, the round trip still lands bit-exactly."""
        model = self.trainer_model(seed=11)
        client = self.client(self.receivers(procs))
        with self.sender(model, client, checksum=True) as sender:
            sender.send_weights()
        assert client.fingerprint() == fingerprint(model.state_dict())

    def test_several_workers_each_get_every_tensor(self, procs: ExitStack) -> None:
        """Every receiver behind a FanoutClient gets every tensor."""
        model = self.trainer_model(seed=5)
        children = self.receivers(procs, self.workers)
        client = self.client(children)
        with self.sender(model, client, workers=self.workers) as sender:
            sender.send_weights(weight_version="fan")
        want = fingerprint(model.state_dict())
        for child in children:
            assert RPCClient(child.address, timeout_s=self.timeout_s).fingerprint() == want

    @pytest.mark.stress
    def test_repeated_updates_land_and_memory_stays_flat(self, procs: ExitStack) -> None:
        """50 updates all land; the receiver's RSS does not grow."""
        model = self.trainer_model()
        client = self.client(self.receivers(procs))
        assert isinstance(client, RPCClient)
        with self.sender(model, client) as sender:
            rss = []
            for step in range(50):
                randomize(model, seed=100 + step)
                sender.send_weights(weight_version=f"s{step}")
                if step % 10 == 9:  # fingerprints cost more than the updates
                    assert client.fingerprint() == fingerprint(model.state_dict()), step
                rss.append(client.status()["rss_bytes"])
        growth = rss[-1] - rss[4]
        assert growth < 16 * MiB, f"receiver RSS grew {growth / MiB:.1f} MiB over 45 updates"

    @pytest.mark.stress
    def test_twenty_senders_in_a_row_shut_down_promptly_and_leak_nothing(
        self, procs: ExitStack
    ) -> None:
        """Create, send and shut down 20 senders against the same receivers: each healthy sender's
        shutdown returns promptly, and threads, host and device memory stay flat on both sides over
        the last ten (host allocators settle during the first ones)."""
        import torch

        model = self.trainer_model()
        count = min(2, self.workers)
        children = self.receivers(procs, count)
        client = self.client(children)
        watchers = [RPCClient(c.address, timeout_s=self.timeout_s) for c in children]

        def usage() -> list[tuple[int, int, int]]:
            """(threads, RSS, CUDA bytes) of the trainer (its CUDA bytes: every device's
            used memory, which sees NCCL's own buffers too) and of each receiver."""
            cuda = 0
            if torch.cuda.is_initialized():
                cuda = sum(total - free for free, total in
                           (torch.cuda.mem_get_info(d) for d in range(torch.cuda.device_count())))
            return [(threading.active_count(), 0, cuda)] + [
                (s["threads"], s["rss_bytes"], s["cuda_bytes"])
                for s in (w.status() for w in watchers)]

        slowest, seen = 0.0, []
        for cycle in range(20):
            sender = self.sender(model, client, workers=count)
            randomize(model, seed=200 + cycle)
            sender.send_weights(weight_version=f"c{cycle}")
            started = time.monotonic()
            sender.shutdown()
            slowest = max(slowest, time.monotonic() - started)
            if cycle in (9, 19):
                seen.append(usage())
        assert slowest < 5.0, f"a healthy sender took {slowest:.1f}s to shut down"
        sides = ["trainer"] + [f"receiver {i}" for i in range(count)]
        for side, (threads0, rss0, cuda0), (threads1, rss1, cuda1) in zip(sides, *seen,
                                                                          strict=True):
            assert threads1 <= threads0, \
                f"{side}: threads grew {threads0} -> {threads1} over 10 senders"
            assert rss1 - rss0 < 20 * MiB, \
                f"{side}: RSS grew {(rss1 - rss0) / MiB:.1f} MiB over 10 senders"
            assert cuda1 - cuda0 < 64 * MiB, \
                f"{side}: CUDA memory grew {(cuda1 - cuda0) / MiB:.1f} MiB"
        want = fingerprint(model.state_dict())
        assert all(w.fingerprint() == want for w in watchers)

    def test_subset_update_changes_only_the_subset(self, procs: ExitStack) -> None:
        """Sending a subset changes exactly those tensors."""
        model = self.trainer_model()
        client = self.client(self.receivers(procs))
        before = client.fingerprint()
        names = [n for n in model.state_dict() if ".mlp." in n][:40]
        sender = trainer_init(self.trainer_info(), client=client,
                              source=ModuleSource(model, names=names))
        sender.send_weights()
        after = client.fingerprint()
        want = fingerprint(model.state_dict())
        assert {n: after[n] for n in names} == {n: want[n] for n in names}
        rest = set(after) - set(names)
        assert rest and all(after[n] == before[n] for n in rest)
        sender.shutdown()

    def test_mismatched_model_is_refused_before_any_weight_changes(
        self, procs: ExitStack
    ) -> None:
        """A shape/dtype mismatch fails the update before any byte is written."""
        model = self.trainer_model()
        client = self.client(self.receivers(procs, model="mixed-mismatch"))
        assert isinstance(client, RPCClient)
        before = client.fingerprint()
        with self.sender(model, client) as sender, pytest.raises(errors.WTransferError) as err:
            sender.send_weights()
        assert "update refused before any weight changed" in str(err.value), repr(err.value)
        assert client.fingerprint() == before
        wait_for(lambda: client.status()["state"] == "failed", self.timeout_s * 3,
                 "the receiver to report the failed update")
        assert client.status()["torn"] is False

    def test_non_finite_values_never_go_live(self, procs: ExitStack) -> None:
        """One NaN in a split tensor and one infinity in a small one (a diverged step): the
        update is refused naming the first, and with rollback on the receiver holds exactly
        what it held before; the next clean update lands. With `allow_non_finite` the same
        values land, bit-exact."""
        child = procs.enter_context(spawn_receiver(self.backend, model=self.model, seed=2,
                                                   device=self.device, rollback=True))
        client = self.client([child])
        assert isinstance(client, RPCClient)
        model = self.trainer_model()
        with self.sender(model, client) as sender:
            sender.send_weights(weight_version="clean")
            before = client.fingerprint()
            tensors = model.state_dict()
            floats = [n for n, t in tensors.items() if t.is_floating_point() and t.numel()]
            split = max(floats, key=lambda n: tensors[n].nbytes)
            small = min(floats, key=lambda n: tensors[n].nbytes)
            tensors[split].view(-1)[-1] = float("nan")
            tensors[small].view(-1)[0] = float("inf")
            with pytest.raises(errors.NonFiniteError, match=f"'{split}' holds NaN or infin"):
                sender.send_weights(weight_version="diverged")
            assert client.fingerprint() == before
            assert client.status()["weight_version"] == "clean"
            tensors[split].view(-1)[-1] = 0.5
            tensors[small].view(-1)[0] = 0.25
            sender.send_weights(weight_version="clean-2")
            assert client.fingerprint() == fingerprint(model.state_dict())
        tensors[split].view(-1)[-1] = float("nan")
        with self.sender(model, client, allow_non_finite=True) as sender:
            sender.send_weights(weight_version="meant")
        assert client.fingerprint() == fingerprint(model.state_dict())
        assert client.status()["weight_version"] == "meant"

    def test_an_update_opened_by_someone_else_is_not_joined(self, procs: ExitStack) -> None:
        """`send_weights` while the engine is inside an update this sender did not open
        (another caller's, or one a stuck trainer left): the start is refused, and the update
        and finish issued right behind it are skipped, so no weight changes and the other
        update stays open."""
        model = self.trainer_model()
        children = self.receivers(procs)
        client = self.client(children)
        other = RPCClient(children[0].address, timeout_s=self.timeout_s)
        before = other.fingerprint()
        with self.sender(model, client) as sender:
            other.start_weight_update()
            with pytest.raises(errors.LifecycleError, match="an update is open"):
                sender.send_weights()
            # while the refused sender is still connected: once it closes, a receiver that
            # watches its sender may fail the open update as abandoned
            assert other.status()["state"] == "updating"
        assert other.fingerprint() == before
        other.close()

    def test_a_replaced_sender_is_refused_before_any_byte_and_the_new_one_lands(
            self, procs: ExitStack) -> None:
        """Two `trainer_init`s on one client (a re-run notebook cell, a restarted trainer):
        the older sender's `send_weights` raises `LifecycleError` saying it was replaced, at
        once and with no weight changed; the receiver is left as it was, and the newer
        sender's updates land bit-exactly, before and after the stale one tried again."""
        old, new = self.trainer_model(seed=21), self.trainer_model(seed=22)
        client = self.client(self.receivers(procs))
        assert isinstance(client, RPCClient)
        before = client.fingerprint()
        stale = self.sender(old, client)
        current = self.sender(new, client)
        try:
            for attempt in range(2):
                started = time.monotonic()
                with pytest.raises(errors.LifecycleError, match="replaced by a newer "
                                                                "trainer_init"):
                    stale.send_weights(weight_version=f"stale-{attempt}")
                assert time.monotonic() - started < self.timeout_s, \
                    "the replaced sender waited out its deadline instead of being refused"
                status = client.status()
                assert status["state"] == "ready" and status["failure"] is None, status
                assert client.fingerprint() == (before if attempt == 0
                                                else fingerprint(new.state_dict()))
                randomize(new, seed=30 + attempt)
                current.send_weights(weight_version=f"current-{attempt}")
                assert client.fingerprint() == fingerprint(new.state_dict())
                assert client.status()["weight_version"] == f"current-{attempt}"
        finally:
            stale.shutdown()
            current.shutdown()

    def test_sender_and_receiver_declare_one_capabilities_record(self) -> None:
        """The backend says what it can do once: its sender and receiver classes hold equal
        `Capabilities` records."""
        backend = get_backend(self.backend)
        if any(hasattr(side, name) for side in (backend.sender_class(), backend.receiver_class())
               for name in LEGACY_CAPABILITY_NAMES):
            pytest.skip("the backend declares its capabilities in the deprecated class "
                        "attributes, one side each")
        assert isinstance(backend.sender_class().capabilities, Capabilities)
        assert backend.sender_class().capabilities == backend.receiver_class().capabilities

    def test_lifecycle_misuse_raises_lifecycle_error(self) -> None:
        """Calls out of order raise LifecycleError with the fix."""
        target = ModuleTarget(self.trainer_model())
        engine = create_receiver(self.backend, target, device=self.device)
        with pytest.raises(errors.LifecycleError, match="init_transfer_engine first"):
            engine.start_weight_update()
        with pytest.raises(errors.LifecycleError):
            engine.update_weights({})
        with pytest.raises(errors.LifecycleError):
            engine.finish_weight_update()
        engine.shutdown()
        with pytest.raises(errors.LifecycleError, match="shut down"):
            engine.init_transfer_engine({})

    def test_bad_init_field_names_backend_and_field(self) -> None:
        """A bad init field is a ValueError naming the backend and field."""
        engine = create_receiver(self.backend, ModuleTarget(self.trainer_model()),
                                 device=self.device)
        with pytest.raises(ValueError, match=rf"{self.backend}.*bucket_bytes"):
            engine.init_transfer_engine({"bucket_bytes": "lots"})
        with pytest.raises(ValueError, match=rf"{self.backend}.*no_such_field"):
            engine.init_transfer_engine({"no_such_field": 1})
        assert engine.state == "new"
        engine.shutdown()

    def test_receiver_that_never_shows_up_times_out(self) -> None:
        """A receiver that is not there is a TransferTimeout, not a hang."""
        client = RPCClient(f"tcp://127.0.0.1:{free_port()}", timeout_s=1.0)
        start = time.monotonic()
        with pytest.raises(errors.TransferTimeout):
            self.sender(self.trainer_model(), client, timeout_s=1.0)
        assert time.monotonic() - start < 30

    def test_receiver_killed_mid_transfer_fails_the_trainer_in_time(
        self, procs: ExitStack
    ) -> None:
        """A receiver SIGKILLed mid-update fails the trainer within its deadline."""
        model = self.trainer_model()
        (child,) = self.receivers(procs)
        client = RPCClient(child.address, timeout_s=self.timeout_s)
        watcher = RPCClient(child.address, timeout_s=self.timeout_s)
        sender = self.sender(model, client)
        outcome: dict[str, Any] = {}

        def send_forever() -> None:
            try:
                while True:
                    sender.send_weights()
            except Exception as exc:
                outcome["error"], outcome["at"] = exc, time.monotonic()

        thread = threading.Thread(target=send_forever, daemon=True)
        thread.start()
        wait_for(lambda: watcher.status()["state"] == "updating", 60, "an update in flight")
        child.kill()
        killed = time.monotonic()
        thread.join(timeout=self.timeout_s * 4 + 30)
        assert not thread.is_alive(), "the trainer hung after its receiver died"
        assert isinstance(outcome["error"], (errors.TransferTimeout, errors.PeerError)), \
            repr(outcome["error"])
        assert outcome["at"] - killed < self.timeout_s * 4 + 30
        sender.shutdown()

    def _kill_a_trainer_mid_update(self, procs: ExitStack, *, trainer_timeout_s: float,
                                   within_s: float, waiting_for: str) -> RPCClient:
        """Start a receiver and a looping trainer child (its `timeout_s` given), SIGKILL the
        trainer while an update is open and wait up to `within_s` for the receiver to fail it;
        returns a client of the receiver."""
        (child,) = self.receivers(procs)
        status = RPCClient(child.address, timeout_s=self.timeout_s)
        trainer = procs.enter_context(spawn_trainer(
            self.backend, child.address, model=self.model, seed=7, device=self.device,
            loop=True, init_fields={"bucket_bytes": self.bucket_bytes,
                                    "timeout_s": trainer_timeout_s, **self.init_fields(1)}))
        assert trainer.info["event"] == "sending"
        wait_for(lambda: status.status()["state"] == "updating", 60, "an update in flight")
        trainer.kill()
        wait_for(lambda: status.status()["state"] == "failed", within_s, waiting_for)
        return status

    def _a_new_trainer_lands(self, status: RPCClient) -> None:
        """After a failed update: a new trainer's update lands bit-exact."""
        model = self.trainer_model(seed=8)
        with self.sender(model, status) as sender:
            sender.send_weights(weight_version="after-crash")
        assert status.fingerprint() == fingerprint(model.state_dict())
        assert status.status()["state"] == "ready"

    def test_trainer_killed_mid_transfer_leaves_receiver_usable(self, procs: ExitStack) -> None:
        """A trainer SIGKILLed mid-update: the receiver fails it, then takes a new trainer."""
        status = self._kill_a_trainer_mid_update(
            procs, trainer_timeout_s=self.timeout_s, within_s=self.timeout_s * 4 + 30,
            waiting_for="the receiver to give up on its dead trainer")
        assert status.status()["failure"]
        self._a_new_trainer_lands(status)

    def test_a_dead_trainer_fails_its_update_without_waiting_out_the_timeout(
            self, procs: ExitStack) -> None:
        """A backend whose receiver can tell its sender is gone (`sender_check_s`) fails a
        killed trainer's open update as soon as it knows, not after `timeout_s` (120 s here;
        the wait below allows half of it), naming why; a new trainer's update then lands."""
        if get_backend(self.backend).receiver_class().capabilities.sender_check_s is None:
            pytest.skip(f"{self.backend} receivers cannot tell their sender is gone; an "
                        "update waits out timeout_s (test_trainer_killed_mid_transfer_...)")
        status = self._kill_a_trainer_mid_update(
            procs, trainer_timeout_s=120.0, within_s=60,
            waiting_for="the receiver to notice its trainer died")
        assert "no call from the sender" not in status.status()["failure"]
        self._a_new_trainer_lands(status)
