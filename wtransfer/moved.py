"""Old module paths kept importable, each with a `DeprecationWarning` naming its new path.

A package that moved modules calls `install(package, {old_leaf: new_path})` from its
`__init__`; `import package.old_leaf` then gives the module at `new_path` (one module object
under both names, its own `__spec__` kept). `new_path` is relative to `package`, or a whole
name starting `wtransfer.` for a module that moved to another package.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import threading
import warnings
from types import ModuleType

_TABLES: dict[str, dict[str, str]] = {}
_LOCK = threading.Lock()


class _MovedModuleLoader(importlib.abc.Loader):
    """Answers an old name with the module at its new path."""

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
    """Finds every old name `install` registered."""

    def find_spec(self, fullname: str, path: object = None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        """A spec that loads the module's new path, for a registered old name; else None."""
        package, _, leaf = fullname.rpartition(".")
        new = _TABLES.get(package, {}).get(leaf)
        if new is None:
            return None
        whole = new if new.startswith("wtransfer.") else f"{package}.{new}"
        return importlib.machinery.ModuleSpec(fullname, _MovedModuleLoader(whole))


def install(package: str, moved: dict[str, str]) -> None:
    """Keep `package.<old>` importable for every `old -> new` of `moved` (new: relative to
    `package`, or a whole `wtransfer.` name); the finder goes on `sys.meta_path` once per
    process."""
    with _LOCK:
        _TABLES.setdefault(package, {}).update(moved)
        if not any(isinstance(finder, MovedModuleFinder) for finder in sys.meta_path):
            sys.meta_path.append(MovedModuleFinder())
