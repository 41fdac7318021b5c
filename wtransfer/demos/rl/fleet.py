"""The demo's fleet: N `wtransfer serve` instances behind a round-robin balancer, updated as
one by a `FanoutClient` in drop mode, with one instance killed and replaced mid-run.

`churn()` SIGKILLs an instance (its requests in flight are sent again to another: what a load
balancer does), and starts a replacement that joins from a surviving instance
(``--weights-from``: it serves the current policy at once) and is added to the fleet; the next
update drops the dead instance and reaches the new one.
"""

from __future__ import annotations

import itertools
import os
import signal
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from wtransfer.control.clients import FanoutClient
from wtransfer.demos.rl.servers import FreshEngineReference, HTTPPolicyServer, Stream


class FleetPolicyServer:
    """`engines` HTTP policy servers as one (the demo's server surface)."""

    def __init__(self, *, engines: int, log_dir: Path | None = None, **server: Any) -> None:
        self.server_args = server
        self.log_dir = log_dir
        self.members = [self._start(i) for i in range(engines)]
        self.client = FanoutClient([m.client for m in self.members], on_failure="drop")
        self.model = self.members[0].model
        self.staging = self.members[0].staging
        self._turn = itertools.count()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=128, thread_name_prefix="fleet-rollout")
        self.events: list[str] = []
        """What happened to the fleet (instances killed, joined), for the demo to print."""

    def _start(self, index: int, **extra: Any) -> HTTPPolicyServer:
        log = self.log_dir / f"server-{index}.log" if self.log_dir is not None else None
        return HTTPPolicyServer(**self.server_args, **extra, log_path=log)

    def _next(self) -> HTTPPolicyServer:
        with self._lock:
            live = [m for m in self.members if m.proc.poll() is None]
            return live[next(self._turn) % len(live)]

    def _post(self, prompt: list[int], params: dict[str, Any]) -> dict[str, Any]:
        """One request, sent again to another instance if the one it went to died."""
        for _ in range(len(self.members) + 1):
            member = self._next()
            try:
                return member._post(prompt, params)
            except Exception:
                if member.proc.poll() is None:
                    raise  # a live instance's error is the request's own
        raise RuntimeError("no instance of the fleet answered")

    def generate(self, prompts: list[list[int]], params: dict[str, Any]
                 ) -> list[Future[dict[str, Any]]]:
        """Submit every prompt at once, round robin over the live instances."""
        return [self._pool.submit(self._post, p, params) for p in prompts]

    def stream(self, prompt: list[int], params: dict[str, Any]) -> Stream:
        """One streamed request on the first live instance."""
        return self._next().stream(prompt, params)

    def churn(self) -> None:
        """Kill the last instance and start a replacement that joins from the first."""
        doomed = self.members[-1]
        os.kill(doomed.proc.pid, signal.SIGKILL)
        doomed.proc.wait(30)
        self.events.append(f"killed instance {doomed.url}")
        peer = self.members[0]
        joined = self._start(len(self.members), weights_from=peer.url)
        with self._lock:
            self.members.append(joined)
        self.client.add(joined.client)
        self.events.append(f"{joined.url} joined from {peer.url} at "
                           f"{joined.weight_version()!r}")

    def pause(self, mode: str, clear_cache: bool) -> None:
        """Pause every live instance."""
        for member in self._live():
            member.pause(mode, clear_cache)

    def resume(self) -> None:
        """Resume every live instance."""
        for member in self._live():
            member.resume()

    def _live(self) -> list[HTTPPolicyServer]:
        return [m for m in self.members if m.proc.poll() is None]

    def weight_version(self) -> str:
        """The first live instance's weight version."""
        return self._live()[0].weight_version()

    def weight_info(self) -> dict[str, Any]:
        """The first live instance's weight info."""
        return self._live()[0].weight_info()

    def stall_ms(self) -> float | None:
        """The first live instance's last update stall."""
        return self._live()[0].stall_ms()

    def inflight(self) -> int:
        """Requests running or waiting on every live instance."""
        return sum(m.inflight() for m in self._live())

    def reference(self, state: dict[str, torch.Tensor]) -> FreshEngineReference:
        """Greedy continuations from a fresh engine holding the weights `state`."""
        return FreshEngineReference(self.model, state)

    def close(self) -> None:
        """Stop every instance."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.client.close()
        for member in self.members:
            member.close()


class PDPolicyServer:
    """A prefill and a decode instance (P/D): requests go to the decode instance, which asks
    the prefill one for each prompt's K/V; both are updated as one (`FanoutClient`)."""

    def __init__(self, *, log_dir: Path | None = None, **server: Any) -> None:
        def log(name: str) -> Path | None:
            return log_dir / f"server-{name}.log" if log_dir is not None else None

        self.prefill = HTTPPolicyServer(**server, log_path=log("prefill"),
                                        extra_args=("--role", "prefill"))
        self.decode = HTTPPolicyServer(**server, log_path=log("decode"), extra_args=(
            "--role", "decode", "--prefill-url", self.prefill.url))
        self.client = FanoutClient([self.prefill.client, self.decode.client])
        self.model = self.decode.model
        self.staging = self.decode.staging

    def generate(self, prompts: list[list[int]], params: dict[str, Any]
                 ) -> list[Future[dict[str, Any]]]:
        """Through the decode instance."""
        return self.decode.generate(prompts, params)

    def stream(self, prompt: list[int], params: dict[str, Any]) -> Stream:
        """Through the decode instance."""
        return self.decode.stream(prompt, params)

    def pause(self, mode: str, clear_cache: bool) -> None:
        """Pause both instances."""
        self.decode.pause(mode, clear_cache)
        self.prefill.pause(mode, clear_cache)

    def resume(self) -> None:
        """Resume both instances."""
        self.prefill.resume()
        self.decode.resume()

    def weight_version(self) -> str:
        """The decode instance's weight version."""
        return self.decode.weight_version()

    def weight_info(self) -> dict[str, Any]:
        """The decode instance's weight info."""
        return self.decode.weight_info()

    def stall_ms(self) -> float | None:
        """The decode instance's last update stall."""
        return self.decode.stall_ms()

    def inflight(self) -> int:
        """Requests on the decode instance."""
        return self.decode.inflight()

    def prefilled(self) -> tuple[int, int]:
        """Requests the decode instance decoded from handed-over K/V, and prefilled itself."""
        lines = dict(line.split(" ", 1) for line in self.decode.http.get("/metrics").text
                     .splitlines() if line.startswith("wtransfer_prefilled_"))
        return (int(float(lines["wtransfer_prefilled_remote_total"])),
                int(float(lines["wtransfer_prefilled_local_total"])))

    def reference(self, state: dict[str, torch.Tensor]) -> FreshEngineReference:
        """Greedy continuations from a fresh engine holding the weights `state`."""
        return FreshEngineReference(self.model, state)

    def close(self) -> None:
        """Stop both instances."""
        self.client.close()
        self.decode.close()
        self.prefill.close()
