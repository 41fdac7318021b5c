"""Staged updates: a shadow copy of the weights that an update lands in while the engine keeps
generating from the live ones, committed at a step boundary.

`StagedWeights` holds one shadow tensor per parameter and buffer of the module (tied weights
share one). A staged update's receiver writes only into the shadow (its target is a
`wtransfer.inference.updates.shard_target.ShardTarget` over `dest`); the live weights change only at
`commit`, on the engine's thread between two steps:

- ``swap`` exchanges the live and shadow storages of every tensor (O(1) each): the shadow then
  holds the previous version, so `rollback` is a swap back, until the next update starts
  staging. The weights' addresses alternate between two sets, and decode graphs are captured
  for both (`shadow_in_place`): no commit waits for a capture;
- ``copy`` copies the shadow into the live storages (pointers never change, for engines whose
  kernels captured them), one copy of what the update wrote; no previous version stays.

The shadow is brought level with the live weights only where an update needs it, never
copying a tensor the update then writes whole: an update that writes only some elements of its
tensors (a delta) levels every tensor that may differ before it writes (`level`), and one that
leaves tensors unwritten has those levelled once it wrote everything (`level_unwritten`), before
a swap exchanges them, so an update that sends only some tensors commits exactly those. A
staged update that fails leaves the live weights as they were; the tensors it wrote are
levelled by a later update that needs them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Literal

import torch
from torch import nn

from wtransfer.errors import ConfigError, LifecycleError, MetadataError, TransferTimeout

StagingMode = Literal["off", "swap", "copy"]
STAGING_MODES: tuple[str, ...] = ("off", "swap", "copy")


def _slots(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every state-dict name of `module` and the parameter or buffer it names (tied weights
    under several names are one object)."""
    return dict(module.state_dict(keep_vars=True))


class StagedWeights:
    """The shadow of `module`'s weights and the commit that makes it live (see the module
    docstring)."""

    def __init__(self, module: nn.Module, mode: StagingMode) -> None:
        if mode not in ("swap", "copy"):
            raise ConfigError(f"staging mode must be 'swap' or 'copy', got {mode!r}")
        self.mode = mode
        self.module = module
        self._live = _slots(module)
        self._owner: dict[str, str] = {}
        """Each name's first name for the same tensor (tied weights share one shadow)."""
        seen: dict[int, str] = {}
        for name, tensor in self._live.items():
            self._owner[name] = seen.setdefault(id(tensor), name)
        with torch.no_grad():
            self.shadow: dict[str, torch.Tensor] = {
                name: tensor.detach().clone() for name, tensor in self._live.items()
                if self._owner[name] == name}
        self.written: set[str] = set()
        """Tensors (by owner name) written into the shadow since the last `prepare`."""
        self._stale: set[str] = set()
        """Tensors whose shadow may differ from the live one; `level` and `level_unwritten`
        copy those the open update has not written (`written`) from the live weights."""
        self._swapped: set[str] = set()
        """Tensors the last swap commit changed (what `rollback` changes back)."""
        self.swaps = 0
        """Storage exchanges so far (captured CUDA graphs read the old addresses after one)."""
        self.previous: str | None = None
        """The version label the shadow holds after a swap commit (what `rollback` brings
        back), else None."""
        self._reserved = False
        """Whether a rollback holds `lock` until a later command (`reserve_rollback`)."""
        self.lock = threading.Lock()
        """Held while the live weights are read or moved: `prepare`, `commit`, `rollback`, a
        push of the live weights from another thread. `shadow_in_place` only takes it when it
        is free, so nothing reading the module sees the shadow in its place."""

    @property
    def nbytes(self) -> int:
        """Bytes of the shadow (one copy of the module's weights)."""
        return sum(t.numel() * t.element_size() for t in self.shadow.values())

    def owner(self, name: str) -> str:
        """The name whose shadow tensor `name` writes (`MetadataError` for an unknown one)."""
        try:
            return self._owner[name]
        except KeyError:
            raise MetadataError(f"unknown tensor {name!r}") from None

    def dest(self, name: str) -> torch.Tensor:
        """The shadow tensor an update writes for `name` (counted as written): it is written
        whole, or `level` ran first (it may hold another version until then)."""
        owner = self.owner(name)
        self.written.add(owner)
        return self.shadow[owner]

    def count_written(self, names: Iterable[str]) -> None:
        """Count `names` as written into the shadow (through views `dest` gave earlier)."""
        self.written.update(self.owner(name) for name in names)

    def shadow_parts(self, names: Iterable[str]) -> Iterator[torch.Tensor]:
        """The shadow tensor of each of `names`, not counted as written."""
        return (self.shadow[self.owner(name)] for name in names)

    def prepare(self) -> None:
        """Open the shadow to an update (waits while a commit or a push holds the live
        weights; refused while a rollback is reserved). Nothing is copied: what differs is
        levelled where the update needs it (see the module docstring). The previous version
        a swap left in the shadow is gone from here on."""
        with self.reading():
            self._stale |= self.written
            self.written.clear()
            self.previous = None

    def level(self) -> None:
        """Copy the live weights into the shadow wherever it may differ and the open update
        has not written: before it writes only some elements of tensors (a delta, an
        adapter's slots), off the step loop."""
        with self.reading():
            self._level(self._stale - self.written)

    def level_unwritten(self) -> None:
        """Once the update wrote everything it will, off the step loop: under swap, copy the
        live weights into the shadow where it may differ and the update did not write (a
        swap exchanges every tensor). Copy staging commits only what was written: nothing to
        do."""
        if self.mode == "swap" and self.written:  # (nothing written: no swap follows)
            self.level()

    @torch.no_grad()
    def _level(self, names: set[str]) -> None:
        for name in sorted(names):
            self.shadow[name].copy_(self._live[name].detach())
        if names:
            self._synchronize()
        self._stale -= names

    def _synchronize(self) -> None:
        """Wait for what this thread queued on the weights' device (nothing on a host)."""
        first = next(iter(self.shadow.values()), None)
        if first is not None and first.is_cuda:
            torch.cuda.current_stream(first.device).synchronize()

    @contextmanager
    def reading(self, wait_s: float = 120.0) -> Iterator[None]:
        """Hold `lock` to read or level the live weights off the engine thread: waits while
        a step boundary's commit or a push holds it (`TransferTimeout` after `wait_s`);
        `LifecycleError` while a rollback holds it reserved (which lasts until a later
        command: waiting could block that command)."""
        deadline = time.monotonic() + wait_s
        while not self.lock.acquire(timeout=0.05):
            if self._reserved:
                raise LifecycleError("a rollback of the weights is reserved here (its ranks "
                                     "agree before any rolls back); start the update once it "
                                     "completed")
            if time.monotonic() > deadline:
                raise TransferTimeout(f"the live weights stayed busy for {wait_s:g}s (a "
                                      "commit or a push held them): the update did not start")
        try:
            yield
        finally:
            self.lock.release()

    @torch.no_grad()
    def commit(self, previous_version: str) -> int:
        """Make what the update wrote live (on the engine's thread, between steps); returns how
        many tensors changed. `previous_version` labels what the shadow holds after a swap."""
        with self.lock:
            names = sorted(self.written)
            if self.mode == "swap":
                if names:
                    self._level(self._stale - self.written)  # (`level_unwritten` did, if run)
                    self._swap_all()
                self._stale |= self.written  # (the shadow holds their previous version)
                self._swapped = set(names)
                self.previous = previous_version
            else:
                for name in names:
                    self._live[name].detach().copy_(self.shadow[name])
                self._stale -= self.written
            self.written.clear()
        return len(names)

    def rollback(self, *, reserved: bool = False) -> int:
        """Swap the previous version back in (swap mode, after a commit and before the next
        update starts staging); returns how many tensors changed. `reserved`: the caller
        holds `reserve_rollback`'s reservation (released here)."""
        if not reserved:
            self.reserve_rollback(hold=False)
        try:
            changed = len(self._swapped)
            if changed:
                self._swap_all()
            self._swapped = set()
            self.previous = None
        finally:
            self._reserved = False
            self.lock.release()
        return changed

    def reserve_rollback(self, *, hold: bool = True) -> None:
        """Take `lock` with a rollback known to be possible; `rollback(reserved=True)` or
        `release_rollback` follows. `hold`: it lasts past this command, and an update starting
        meanwhile is refused (`reading`). `LifecycleError`, nothing held, under copy staging, while
        the weights are read, or with no previous version."""
        if self.mode != "swap":
            raise LifecycleError("rollback_weights needs update_staging='swap': copy staging "
                                 "copies the new weights over the old ones, keeping none")
        if not self.lock.acquire(blocking=False):
            raise LifecycleError("the live weights are being read (an update is starting, or "
                                 "they are being pushed to a joining instance); roll back "
                                 "once that is done")
        if self.previous is None:
            self.lock.release()
            raise LifecycleError("no previous weight version is resident: rollback is "
                                 "possible once after an update committed, until the "
                                 "next update starts")
        self._reserved = hold

    def release_rollback(self) -> None:
        """Give up a reservation (`reserve_rollback`): another rank refused."""
        self._reserved = False
        self.lock.release()

    def _swap_all(self) -> None:
        """Exchange the live and shadow storages of every tensor (every alias follows, since
        aliases are one parameter object). Those an update did not write are equal on both
        sides; exchanging them too keeps the weights' addresses alternating between two sets,
        the ones decode graphs were captured for (`shadow_in_place`)."""
        self.shadow.update(self._place(self.shadow))
        self.swaps += 1
        self._synchronize()

    @contextmanager
    def shadow_in_place(self) -> Iterator[bool]:
        """While open, the module reads the shadow's storages (its weights' addresses after the next
        swap commit or rollback), to capture graphs there; yields False, nothing moved, while `lock`
        is held. On the engine thread between steps; what runs inside must not depend on values."""
        if self.mode != "swap":
            raise LifecycleError("only swap staging moves the weights' storages")
        if not self.lock.acquire(blocking=False):
            yield False
            return
        try:
            held = self._place(self.shadow)
            try:
                yield True
            finally:
                self._place(held)
        finally:
            self.lock.release()

    def _place(self, storages: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Make each named live tensor use the storage `storages` gives it (every alias
        follows: aliases are one parameter object); returns the storages they had."""
        held = {}
        for name, storage in storages.items():
            live = self._live[name]
            held[name] = live.data
            live.data = storage
        return held

    @property
    def other_weights(self) -> Callable[[], AbstractContextManager[bool]] | None:
        """`shadow_in_place` where commits move the weights' storages (swap), else None."""
        return self.shadow_in_place if self.mode == "swap" else None
