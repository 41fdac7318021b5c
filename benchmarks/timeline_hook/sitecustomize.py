"""Marks for `benchmarks/update_timeline.py`, in every process started with
`WTRANSFER_TIMELINE` set to a directory (and this directory first on `PYTHONPATH`).

As each traced module is imported, the functions named in `TRACED` are wrapped: a line
`role<TAB>thread<TAB>label>` before each call and `...label<` after it, with the
system-wide monotonic clock in nanoseconds, goes to `<dir>/<pid>.tsv` (one write per mark,
so a process killed at shutdown keeps what it marked). Nothing is wrapped without the
variable; benchmarks only.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import inspect
import os
import re
import sys
import threading
import time
from typing import Any

TRACED: dict[str, list[tuple[str, str]]] = {
    # trainer ranks
    "wtransfer.trainer.engine": [("TrainerTransferEngine.send_weights", "send")],
    "wtransfer_ipc.sender": [("IPCSender._wait_read", "wait read"),
                             ("IPCSender._outgoing_in_place", "in place outgoing")],
    "wtransfer.trainer.group": [("Ranks.gather", "gather records")],
    "wtransfer.trainer.layouts": [("LocalShards.pack", "pack")],
    "wtransfer.control.clients": [("HTTPClient.update_weights", "post update"),
                          ("HTTPClient.start_weight_update", "post start"),
                          ("HTTPClient.finish_weight_update", "post finish")],
    "wtransfer.protocol": [("CallQueue._run_batch", "post batch")],
    # the engine's HTTP server and its engine thread
    "wtransfer.inference.async_engine": [("AsyncEngine.update_weights", "http update"),
                                         ("AsyncEngine.finish_weight_update", "http finish")],
    "wtransfer.inference.engine_core": [("EngineCore._run_command", "run {1}")],
    "wtransfer.inference.tp.workers": [("TPWorkers.call_all", "call workers"),
                                       ("TPWorkers.wait", "wait workers")],
    # every rank's receiver (rank 0 in the engine process, the others in the workers)
    "wtransfer.receiver.engine": [("parse_record", "parse record"),
                                  ("WeightTransferEngine.update_weights", "receive"),
                                  ("WeightTransferEngine.start_weight_update", "start"),
                                  ("WeightTransferEngine.finish_weight_update", "finish")],
    "wtransfer.receiver.session": [("UpdateSession.consume_pieces", "consume pieces"),
                                   ("UpdateSession.consume", "consume"),
                                   ("UpdateSession.load_whole", "load whole"),
                                   ("UpdateSession.load_boxes", "load boxes"),
                                   ("UpdateSession.finish", "session finish")],
    "wtransfer_ipc.zero_copy": [("ZeroCopyImports.sources", "zero-copy sources")],
    "wtransfer_ipc.m2n_in_place": [("RanksInPlace.load", "ranks in place")],
    "wtransfer_ipc.receiver": [("drain", "drain"), ("pieces_from_wire", "pieces from wire"),
                               ("IPCReceiver._receive", "ipc receive"),
                               ("IPCReceiver._receive_in_place", "receive in place")],
    "wtransfer_ipc.cuda": [("SenderEvents.wait", "event wait"),
                           ("SenderEvents.record", "event record")],
}

_role: list[str] = []
_out: list[int] = []


def _role_name() -> str:
    if not _role:
        argv = " ".join(sys.argv)
        if "tp.worker" in argv or "tp/worker" in argv:
            rank = sys.argv[sys.argv.index("--rank") + 1] if "--rank" in sys.argv else "?"
            _role.append(f"worker{rank}")
        elif "trainer_ranks" in argv:
            rank = sys.argv[sys.argv.index("--rank") + 1] if "--rank" in sys.argv else "?"
            _role.append(f"rank{rank}")
        elif " serve" in argv:
            _role.append("engine")
        else:
            _role.append(os.path.basename(sys.argv[0] if sys.argv else "python"))
        _out.append(os.open(os.path.join(os.environ["WTRANSFER_TIMELINE"],
                                         f"{os.getpid()}.tsv"),
                            os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644))
    return _role[0]


def mark(label: str) -> None:
    """Write one mark of this process at the monotonic clock."""
    role = _role_name()
    line = f"{role}\t{threading.current_thread().name}\t{label}\t{time.monotonic_ns()}\n"
    os.write(_out[0], line.encode())


def _label(template: str, args: tuple[Any, ...]) -> str:
    """`template` with the arguments it names ("{1}"); no other argument is turned into
    text (a tensor's text would read the device)."""
    if "{" not in template:
        return template
    named = {int(i) for i in re.findall(r"\{(\d+)\}", template)}
    try:
        return template.format(*(str(a) if i in named else "" for i, a in enumerate(args)))
    except IndexError:
        return template


def _wrap(owner: Any, attr: str, template: str) -> None:
    original = inspect.getattr_static(owner, attr)
    func = original.__func__ if isinstance(original, (staticmethod, classmethod)) else original
    if inspect.iscoroutinefunction(func):
        @functools.wraps(func)
        async def traced_async(*args: Any, **kwargs: Any) -> Any:
            label = _label(template, args)
            mark(label + ">")
            try:
                return await func(*args, **kwargs)
            finally:
                mark(label + "<")

        setattr(owner, attr, traced_async)
        return

    @functools.wraps(func)
    def traced(*args: Any, **kwargs: Any) -> Any:
        label = _label(template, args)
        mark(label + ">")
        try:
            return func(*args, **kwargs)
        finally:
            mark(label + "<")

    setattr(owner, attr, traced)


def _patch(module: Any, targets: list[tuple[str, str]]) -> None:
    for qualname, template in targets:
        owner_name, _, attr = qualname.rpartition(".")
        owner = getattr(module, owner_name) if owner_name else module
        _wrap(owner, attr, template)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds a traced module as the other finders would, and wraps its functions once it ran."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name not in TRACED:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            run(module)
            _patch(module, TRACED[name])

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


if os.environ.get("WTRANSFER_TIMELINE"):
    sys.meta_path.insert(0, _Finder())
