"""What the M->N tests share: init fields per backend and `wtransfer serve` in a subprocess."""

import signal
import subprocess
import sys
import tempfile

import httpx

from wtransfer.launch.processes import free_port
from wtransfer.testing.conformance import wait_for

BUCKET = 16 << 10
"""Smaller than most tensors of the tiny models: pieces are cut across pair buckets."""


def fields(backend="nccl", **extra):
    """Init fields of an M->N sender: sharded ranks that each hold a client go M->N by
    default over every backend (ipc: through shared memory; CUDA staging and replicas ask
    with m2n=True)."""
    where = {"nccl": {"master_address": "127.0.0.1"}}.get(backend, {})
    return {**where, "bucket_bytes": BUCKET, "timeout_s": 30.0, **extra}


class Serve:
    """`wtransfer serve` in a subprocess; its output (and its workers') goes to a file, not a
    pipe nobody reads while the test runs (a full pipe would stall the server). The port is
    picked free, but the server binds it only once its model is up, and under a parallel
    suite another process can take it first: then it starts again on another port."""

    ATTEMPTS = 3

    def __init__(self, *flags, backend="nccl"):
        self.log = tempfile.TemporaryFile("w+", errors="replace")  # noqa: SIM115 (closed in close)
        for attempt in range(self.ATTEMPTS):
            self.log.seek(0)
            self.log.truncate()
            self.url = f"http://127.0.0.1:{free_port()}"
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "wtransfer", "serve", "--port",
                 self.url.rsplit(":", 1)[1], "--weight-transfer-backend", backend,
                 "--batch-invariant", "--dev-mode", *flags],
                stdout=self.log, stderr=subprocess.STDOUT, text=True)
            try:
                wait_for(self._healthy, 120, "the server to start")
                break
            except BaseException:  # (not in the fixture's list yet: nobody else would stop it)
                taken = "address already in use" in self.output().lower()
                if not taken or attempt == self.ATTEMPTS - 1:
                    self.close()
                    raise
                self._stop()
        self.http = httpx.Client(base_url=self.url, timeout=60)

    def _healthy(self):
        assert self.proc.poll() is None, self.output()
        try:
            return httpx.get(self.url + "/health", timeout=1).status_code == 200
        except httpx.TransportError:
            return False

    def greedy(self, prompt, n=12):
        out = self.http.post("/inference/v1/generate", json={
            "token_ids": prompt, "sampling_params": {"max_tokens": n, "temperature": 0}})
        assert out.status_code == 200, out.text
        return out.json()["choices"][0]["token_ids"]

    def output(self):
        """What the server and its workers printed so far."""
        self.log.seek(0)
        return self.log.read()

    def close(self):
        self._stop()
        print(self.output()[-4000:])  # pytest shows it where the test failed
        self.log.close()

    def _stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
