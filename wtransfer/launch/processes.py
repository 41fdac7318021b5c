"""Run receivers and trainers as real child processes (see `wtransfer.launch.peer`), and find free
ports; used by the demos, the benchmarks and the conformance suite."""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta
from typing import Any

from wtransfer import wire
from wtransfer.errors import TransferTimeout


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (for test servers that must be told a port;
    another process can take it before it is bound, so prefer binding port 0 directly)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def local_store(world_size: int, timeout_s: float, port: int = 0) -> Any:
    """A `torch.distributed.TCPStore` on 127.0.0.1 for a default process group launched from
    here: `port=0` hosts one on a port the OS picks (read `.port`, hand it to the ranks),
    any other port joins that one. No window for another process to take the port."""
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", port, world_size, port == 0,
                         timedelta(seconds=timeout_s), wait_for_workers=False)


class ChildProcess:
    """A worker child; `info` is the JSON object it printed first. Use as a context manager."""

    def __init__(self, role: str, *, backend: str, model: str = "mixed", seed: int = 0,
                 device: str = "cpu", fill: str = "random", address: str = "",
                 init_fields: dict[str, Any] | None = None,
                 loop: bool = False, vary: bool = False, rollback: bool = False,
                 gpu_busy: bool = False, env: dict[str, str] | None = None,
                 start_timeout_s: float = 120.0) -> None:
        self.role = role
        cmd = [sys.executable, "-m", "wtransfer.launch.peer", role, "--backend", backend,
               "--model", model, "--seed", str(seed), "--device", device, "--fill", fill]
        if address:
            cmd += ["--address", address]
        if init_fields:
            cmd += ["--init-hex", wire.encode(init_fields).hex()]
        if loop:
            cmd.append("--loop")
        if vary:
            cmd.append("--vary")
        if rollback:
            cmd.append("--rollback")
        if gpu_busy:
            cmd.append("--gpu-busy")
        self.proc = subprocess.Popen(  # with faulthandler on, a crash prints its stack
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            env={**os.environ, "PYTHONFAULTHANDLER": "1", **(env or {})},
        )
        self.info: dict[str, Any] = self.read_line(start_timeout_s)

    def read_line(self, timeout_s: float) -> dict[str, Any]:
        """The next JSON line the child prints, within `timeout_s`."""
        assert self.proc.stdout is not None
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not sel.select(left):
                    self.kill()
                    raise TransferTimeout(f"child {self.role} printed nothing within "
                                          f"{timeout_s}s")
                line = self.proc.stdout.readline()
                if not line:
                    code = self.proc.wait(timeout=10)
                    raise RuntimeError(f"child {self.role} exited with {code}")
                if line.startswith("{"):
                    return dict(json.loads(line))
        finally:
            sel.close()

    @property
    def address(self) -> str:
        """The receiver's RPC address."""
        return str(self.info["address"])

    def kill(self) -> None:
        """SIGKILL the child (a crash, from the peer's point of view)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def close(self) -> None:
        """Ask the child to exit (stdin EOF); kill it if it does not within 10 s."""
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None and not stream.closed:
                stream.close()

    def __enter__(self) -> ChildProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def spawn_receiver(backend: str, **kwargs: Any) -> ChildProcess:
    """Start a receiver child serving `wtransfer.rpc`; its address is `.address`."""
    return ChildProcess("receiver", backend=backend, **kwargs)


def spawn_trainer(backend: str, address: str, **kwargs: Any) -> ChildProcess:
    """Start a trainer child sending to `address` (with loop=True, until killed)."""
    return ChildProcess("trainer", backend=backend, address=address, **kwargs)
