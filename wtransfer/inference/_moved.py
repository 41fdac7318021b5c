"""Old module paths of the engine, kept importable with a `DeprecationWarning`.

The engine was packaged by layer (model, steps, updates, serving); `import
wtransfer.inference.replica` still works and gives the module now at
`wtransfer.inference.updates.replica`.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType

MOVED: dict[str, str] = {
    "attention": "model.attention",
    "parallel": "model.parallel",
    "experts": "model.experts",
    "fp8_linear": "model.fp8_linear",
    "fp8_matmul": "model.fp8_matmul",
    "scheduler": "steps.scheduler",
    "block_manager": "steps.block_manager",
    "sequence": "steps.sequence",
    "runner": "steps.runner",
    "decode_graphs": "steps.decode_graphs",
    "replica": "updates.replica",
    "staging": "updates.staging",
    "shard_target": "updates.shard_target",
    "transfer_lane": "updates.transfer_lane",
    "stall": "updates.stall",
    "release": "updates.release",
    "lora": "updates.lora",
    "server": "serving.server",
    "http_body": "serving.http_body",
    "disaggregation": "serving.disaggregation",
    "handover": "serving.handover",
    "join": "serving.join",
}
"""Old module name under `wtransfer.inference` -> its path there now."""

_PACKAGE = "wtransfer.inference"


class _MovedModuleLoader(importlib.abc.Loader):
    """Answers an old name with the module at its new path (one module object, two names)."""

    def __init__(self, new_name: str) -> None:
        self._new_name = new_name
        self._own_spec: importlib.machinery.ModuleSpec | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        """Imports the module under its new name (and warns that the old one is deprecated)."""
        warnings.warn(f"{spec.name} moved to {self._new_name}; import it from there",
                      DeprecationWarning, stacklevel=2)
        module = importlib.import_module(self._new_name)
        self._own_spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        """Gives the module back its own spec (the import system set the old name's)."""
        module.__spec__ = self._own_spec


class MovedModuleFinder(importlib.abc.MetaPathFinder):
    """Finds `wtransfer.inference.<old>` for every name in `MOVED`."""

    def find_spec(self, fullname: str, path: object = None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        package, _, leaf = fullname.rpartition(".")
        if package != _PACKAGE or leaf not in MOVED:
            return None
        new_name = f"{_PACKAGE}.{MOVED[leaf]}"
        return importlib.machinery.ModuleSpec(fullname, _MovedModuleLoader(new_name))


def install() -> None:
    """Puts the finder on `sys.meta_path` once."""
    if not any(isinstance(finder, MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.append(MovedModuleFinder())
