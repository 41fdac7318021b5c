"""The single-process engine core: one `Replica` driven by a thread of its own.

Everything that touches the scheduler or the weights runs on that thread, between steps:
requests, aborts, pause/resume and every weight-transfer call arrive as commands
(`submit(name, ...)`, one of `wtransfer.inference.commands.COMMANDS`, returns a
`concurrent.futures.Future`), so a pause or an update never lands in the middle of a forward
pass.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from wtransfer.errors import LifecycleError
from wtransfer.inference.commands import Emit, check_command
from wtransfer.inference.config import EngineConfig
from wtransfer.inference.replica import Replica


class EngineCore(Replica):
    """One model replica with its own thread (see the module docstring)."""

    def __init__(self, config: EngineConfig, emit: Emit) -> None:
        super().__init__(config, emit)
        self._commands: deque[tuple[Callable[..., Any], tuple[Any, ...], Future[Any]]] = deque()
        self._wake = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="wtransfer-engine-core",
                                        daemon=True)
        self._thread.start()

    def call(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        """Run `fn(*args)` on the engine thread between steps."""
        future: Future[Any] = Future()
        with self._wake:
            if self._stopped:
                future.set_exception(LifecycleError("the engine is shut down"))
                return future
            self._commands.append((fn, args, future))
            self._wake.notify()
        return future

    def submit(self, command: str, *args: Any) -> Future[Any]:
        """Run the named command (one of `COMMANDS`) on the engine thread."""
        check_command(command)
        return self.call(getattr(self, command), *args)

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._commands and not self._stopped and not self.can_step():
                    self._wake.wait(0.5)  # an update failed by its watchdog: step again
                if self._stopped and not self._commands:
                    return
                commands = list(self._commands)
                self._commands.clear()
            for fn, args, future in commands:
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(fn(*args))
                    except BaseException as exc:
                        future.set_exception(exc)
            if self.can_step():
                self.step()
            self.resolve_drains()

    def shutdown(self) -> None:
        """Abort every request, stop the thread and release the receiver."""
        done = self.call(self.abort, None)
        with self._wake:
            self._stopped = True
            self._wake.notify()
        done.result(timeout=self.config.step_timeout_s)
        self._thread.join(timeout=self.config.step_timeout_s)
        if self.receiver is not None:
            self.receiver.shutdown()
