"""Prefill/decode disaggregation against one monolithic engine: time to first token, decode
tokens per second and K/V bytes per request, on real servers in one run.

    python benchmarks/pd.py --models tiny,qwen3-0.6b --requests 8 --prompt 64 --tokens 32

Each configuration starts its servers (`wtransfer serve`, batch-invariant, ipc), streams
`--requests` greedy requests one after another (so the times are one request's), and prints
the medians: first token (from sending the request to its first streamed token), decode
tokens per second (the rest), and the K/V bytes the decode instance received per request
against the prompt's K/V size.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from common import print_table, progress, write_json

from wtransfer.inference import MODEL_CONFIGS
from wtransfer.launch.processes import free_port


class Server:
    """`wtransfer serve` in a child process."""

    def __init__(self, model: str, *flags: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen([sys.executable, "-m", "wtransfer", "serve", "--model",
                                      model, "--port", str(self.port), "--batch-invariant",
                                      *flags], stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.log.seek(0)
                raise RuntimeError(f"server did not start: {self.log.read()[-2000:]!r}")
            time.sleep(0.2)

    def metric(self, name: str) -> float:
        """One /metrics value."""
        for line in httpx.get(self.url + "/metrics").text.splitlines():
            if line.startswith(f"wtransfer_{name} "):
                return float(line.split()[1])
        return 0.0

    def stop(self) -> None:
        """Stop it."""
        self.proc.terminate()
        self.proc.wait(60)
        self.log.close()


def stream_one(url: str, prompt: list[int], tokens: int) -> tuple[float, float, str]:
    """One greedy streamed request: seconds to its first token, decode tokens per second,
    and where it was prefilled."""
    body = {"token_ids": prompt, "sampling_params": {"max_tokens": tokens, "temperature": 0},
            "stream": True}
    start = time.perf_counter()
    first = None
    final: dict[str, Any] = {}
    with httpx.stream("POST", url + "/inference/v1/generate", json=body, timeout=300) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if first is None and event.get("token_ids"):
                first = time.perf_counter()
            if "choices" in event:
                final = event["choices"][0]
    end = time.perf_counter()
    assert first is not None
    return first - start, (tokens - 1) / max(end - first, 1e-9), final["prefilled_by"]


def run(model: str, mode: str, requests: int, prompt_len: int, tokens: int
        ) -> dict[str, Any]:
    """Start the servers of `mode` ("monolithic" or "P/D") and time the requests."""
    servers = []
    if mode == "monolithic":
        servers.append(Server(model))
        url = servers[0].url
    else:
        servers.append(Server(model, "--role", "prefill"))
        servers.append(Server(model, "--role", "decode", "--prefill-url", servers[0].url))
        url = servers[1].url
    try:
        vocab = MODEL_CONFIGS[model].vocab_size
        ttft, rate, where = [], [], []
        for i in range(requests + 1):  # the first warms up
            prompt = [(7 * i + 3 * j) % vocab for j in range(prompt_len)]
            t, r, w = stream_one(url, prompt, tokens)
            if i:
                ttft.append(t)
                rate.append(r)
                where.append(w)
        moved = servers[-1].metric("kv_bytes_received_total") / (requests + 1)
    finally:
        for server in servers:
            server.stop()
    config = MODEL_CONFIGS[model]
    itemsize = 2 if str(config.torch_dtype) in ("bfloat16", "float16") else 4
    kv_size = (2 * config.num_hidden_layers * prompt_len * config.num_key_value_heads
               * config.head_dim * itemsize)
    progress(f"{model} {mode}: first token {statistics.median(ttft) * 1e3:.1f} ms")
    return {"model": model, "mode": mode, "ttft_ms": statistics.median(ttft) * 1e3,
            "tokens_per_s": statistics.median(rate), "prefilled": "/".join(sorted(set(where))),
            "kv_kib": moved / 1024, "kv_size_kib": kv_size / 1024}


def main() -> None:
    """Run every model in both modes and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="tiny,qwen3-0.6b")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    rows = [run(model, mode, args.requests, args.prompt, args.tokens)
            for model in args.models.split(",") for mode in ("monolithic", "P/D")]
    print_table(rows, [("model", "model", ""), ("mode", "mode", ""),
                       ("ttft_ms", "first token ms", ".1f"),
                       ("tokens_per_s", "decode tok/s", ".1f"), ("prefilled", "prefilled", ""),
                       ("kv_kib", "K/V KiB moved", ".1f"),
                       ("kv_size_kib", "prompt K/V KiB", ".1f")])
    print(f"wrote {write_json('pd', rows, vars(args))}")


if __name__ == "__main__":
    main()
