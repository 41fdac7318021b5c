"""The backend registry: descriptors, entry-point discovery, and lookup.

Backends are plugin distributions that declare an entry point in the group
``wtransfer.backends`` pointing at a `Backend`. Classes are named by dotted strings and imported
on first use, so listing backends never imports a backend's heavy dependencies, and a plugin
that fails to load is reported instead of breaking the others.
"""

from __future__ import annotations

import importlib
import importlib.util
import threading
from dataclasses import dataclass
from importlib.metadata import entry_points
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from wtransfer.errors import ConfigError

if TYPE_CHECKING:
    from collections.abc import Mapping

    from wtransfer.protocol import WeightSyncClient
    from wtransfer.receiver.engine import WeightTransferEngine
    from wtransfer.receiver.target import WeightTarget
    from wtransfer.records import TrainerInitInfo
    from wtransfer.trainer.engine import TrainerTransferEngine
    from wtransfer.trainer.source import WeightSource

ENTRY_POINT_GROUP = "wtransfer.backends"


@dataclass(frozen=True)
class Backend:
    """A backend: one name for both sides, classes as ``"module:Class"`` strings or classes.
    `requires` lists importable modules it needs; when one is missing the backend is listed as
    unavailable with `install_hint` as the reason."""

    name: str
    receiver: str | type
    sender: str | type
    summary: str = ""
    requires: tuple[str, ...] = ()
    install_hint: str = ""

    def __post_init__(self) -> None:
        if not self.name or not self.name.replace("_", "").replace("-", "").isalnum():
            raise ConfigError(f"backend name must be alphanumeric (with - or _), "
                              f"got {self.name!r}")

    def missing(self) -> str | None:
        """Why this backend cannot be used here, or None when its dependencies are present."""
        for module in self.requires:
            try:
                found = importlib.util.find_spec(module) is not None
            except (ImportError, ValueError):
                found = False
            if not found:
                hint = f"; {self.install_hint}" if self.install_hint else ""
                return f"module {module!r} is not installed{hint}"
        return None

    def receiver_class(self) -> type[WeightTransferEngine[Any, Any]]:
        """Import (first time only) and return the receiver class."""
        return self._load(self.receiver)

    def sender_class(self) -> type[TrainerTransferEngine[Any]]:
        """Import (first time only) and return the sender class."""
        return self._load(self.sender)

    def _load(self, ref: str | type) -> Any:
        if not isinstance(ref, str):
            return ref
        reason = self.missing()
        if reason is not None:
            raise ImportError(f"backend {self.name!r} is unavailable: {reason}")
        module_name, _, attr = ref.partition(":")
        module = importlib.import_module(module_name)
        return getattr(module, attr)


@dataclass(frozen=True)
class BackendInfo:
    """One row of `list_backends()`."""

    name: str
    summary: str
    distribution: str
    available: bool
    reason: str


_lock = threading.Lock()
_runtime: dict[str, Backend] = {}
# name -> (backend or None when broken, distribution, error)
_discovered: dict[str, tuple[Backend | None, str, str]] | None = None


def _discover() -> dict[str, tuple[Backend | None, str, str]]:
    global _discovered
    with _lock:
        if _discovered is None:
            found: dict[str, tuple[Backend | None, str, str]] = {}
            for ep in entry_points(group=ENTRY_POINT_GROUP):
                dist = ep.dist.name if ep.dist is not None else "?"
                try:
                    backend = ep.load()
                    if not isinstance(backend, Backend):
                        raise TypeError(f"{ep.value} is a {type(backend).__name__}, not a Backend")
                    if backend.name != ep.name:
                        raise ValueError(f"entry point {ep.name!r} names backend {backend.name!r}")
                    found[ep.name] = (backend, dist, "")
                except Exception as exc:  # a broken plugin must not break the others
                    found[ep.name] = (None, dist, f"failed to load: {type(exc).__name__}: {exc}")
            _discovered = found
        return _discovered


def refresh() -> None:
    """Forget discovered entry points (after installing a plugin in a running process)."""
    global _discovered
    with _lock:
        _discovered = None


def register_backend(backend: Backend, *, replace: bool = False) -> None:
    """Register a backend at run time; a taken name raises `ConfigError` unless `replace`."""
    if not isinstance(backend, Backend):
        raise TypeError(f"expected a Backend, got {type(backend).__name__}")
    taken = backend.name in _runtime or backend.name in _discover()
    if taken and not replace:
        raise ConfigError(f"backend {backend.name!r} is already registered; "
                          "pass replace=True to override it")
    with _lock:
        _runtime[backend.name] = backend


def registered_backends() -> Mapping[str, Backend]:
    """Read-only view of every loadable backend by name (runtime registrations win)."""
    merged = {n: b for n, (b, _, _) in _discover().items() if b is not None}
    merged.update(_runtime)
    return MappingProxyType(merged)


def get_backend(name: str) -> Backend:
    """The backend called `name`; an unknown or broken name raises `ConfigError`."""
    if name in _runtime:
        return _runtime[name]
    discovered = _discover()
    if name in discovered:
        backend, dist, error = discovered[name]
        if backend is None:
            raise ConfigError(f"backend {name!r} (from {dist}) is broken: {error}")
        return backend
    known = sorted(set(_runtime) | set(discovered))
    raise ConfigError(f"unknown backend {name!r}; known backends: {known or 'none installed'}")


def list_backends() -> dict[str, BackendInfo]:
    """Every backend with its availability and, when unavailable, the reason."""
    rows: dict[str, BackendInfo] = {}
    for name, (backend, dist, error) in _discover().items():
        if backend is None:
            rows[name] = BackendInfo(name, "", dist, False, error)
        else:
            reason = backend.missing()
            rows[name] = BackendInfo(name, backend.summary, dist, reason is None, reason or "")
    for name, backend in _runtime.items():
        reason = backend.missing()
        rows[name] = BackendInfo(name, backend.summary, "(runtime)", reason is None, reason or "")
    return dict(sorted(rows.items()))


def create_receiver(
    name: str, target: WeightTarget, *, device: str = "cpu", worker_index: int = 0,
    rollback: bool = False,
) -> WeightTransferEngine[Any, Any]:
    """Instantiate backend `name`'s receiver over `target` on `device`; `worker_index` is its
    index among its engine's receiving workers (a data-parallel engine's rank); `rollback`
    restores the old weights when an update fails (see `WeightTransferEngine`)."""
    return get_backend(name).receiver_class()(target, device=device, worker_index=worker_index,
                                              rollback=rollback)


def trainer_init(
    init_info: TrainerInitInfo, *, client: WeightSyncClient | None, source: WeightSource,
    process_group: Any = None,
) -> TrainerTransferEngine[Any]:
    """Create the sender for `init_info`'s backend and initialize every receiver behind `client`.
    With a sharded source (FSDP2 / DTensor), `client=None` on some ranks, or `process_group`, every
    trainer rank of the group calls this (and `send_weights`) together; ranks with a client send."""
    name = getattr(type(init_info), "backend", "")
    if not name:
        raise ConfigError(f"{type(init_info).__name__} names no backend; pass a backend's "
                          "TrainerInitInfo subclass (e.g. wtransfer_ipc.IPCTrainerInitInfo)")
    return get_backend(name).sender_class().trainer_init(init_info, client=client, source=source,
                                                         process_group=process_group)
