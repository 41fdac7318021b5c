"""`wtransfer serve --model tiny` in a process of its own, for the HTTP tests."""

import signal
import subprocess
import sys
import tempfile

import httpx

from wtransfer.launch.processes import free_port
from wtransfer.testing.conformance import wait_for

KEY = "s3cret"


class Server:
    def __init__(self, *flags, port=None):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # to a file: a pipe nobody reads while the module's tests run would stall the server
        self.log = tempfile.TemporaryFile("w+", errors="replace")  # noqa: SIM115
        self.proc = subprocess.Popen([sys.executable, "-m", "wtransfer", "serve",
                                      "--model", "tiny", "--port", str(self.port), *flags],
                                     stdout=self.log, stderr=subprocess.STDOUT, text=True)
        headers = {"Authorization": f"Bearer {KEY}"} if "--api-key" in flags else {}
        def healthy():
            assert self.proc.poll() is None, self.output()
            try:
                return httpx.get(self.url + "/health", headers=headers,
                                 timeout=1).status_code == 200
            except httpx.TransportError:
                return False

        try:
            wait_for(healthy, 60, "the server to start")
        except BaseException:  # a server that did not come up must not outlive the test
            self.proc.kill()
            self.proc.wait(timeout=30)
            print(f"the server did not come up; its output:\n{self.output()[-3000:]}")
            raise
        self.http = httpx.Client(base_url=self.url, headers=headers, timeout=60)

    def output(self):
        self.log.seek(0)
        return self.log.read()

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=30)
        out = self.output()
        self.log.close()
        return out
