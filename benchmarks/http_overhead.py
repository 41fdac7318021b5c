"""Benchmark: the HTTP control plane's cost, measured against the in-process path in one run.

    python benchmarks/http_overhead.py --models tiny,small
    python benchmarks/http_overhead.py --models tiny --tp 2 --repeats 41   # 2 TP workers

Weight update: `send_weights` through the ipc backend with the in-process client (the engine's
own `LocalEngineClient`) and with `HTTPClient` to `wtransfer serve --dev-mode` in a child
process; the difference is the HTTP overhead. Generation: 32 concurrent greedy requests of 64
tokens in process and through the server. Control call: `GET /weight_info` through
`HTTPClient` and through a bare httpx client, median of 200 each.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
from wtransfer_ipc import IPCTrainerInitInfo

import wtransfer
from wtransfer.inference import (
    AsyncEngine,
    EngineConfig,
    LocalEngineClient,
    SamplingParams,
    load_model,
)
from wtransfer.launch.processes import free_port

sys.path.insert(0, str(Path(__file__).parent))
from common import median_seconds, print_table, write_json

REQUESTS, TOKENS = 32, 64


def update_seconds(client: Any, model_name: str, repeats: int) -> float:
    source = wtransfer.ModuleSource(load_model(model_name, seed=7))
    with wtransfer.trainer_init(IPCTrainerInitInfo(bucket_bytes=16 << 20), client=client,
                                source=source) as sender:
        return median_seconds(sender.send_weights, repeats)


def in_process(model_name: str, repeats: int, tp: int) -> tuple[float, float]:
    engine = AsyncEngine(EngineConfig(model=model_name, max_num_seqs=64,
                                      tensor_parallel_size=tp))
    update = update_seconds(LocalEngineClient(engine), model_name, repeats)

    async def generate_all() -> None:
        async def one(i: int) -> None:
            async for _ in engine.generate([i + 1, 2, 3], SamplingParams(
                    max_tokens=TOKENS, temperature=0.0)):
                pass
        await asyncio.gather(*[one(i) for i in range(REQUESTS)])

    start = time.perf_counter()
    asyncio.run(generate_all())
    gen = time.perf_counter() - start
    engine.shutdown()
    return update, gen


def control_call_seconds(url: str) -> tuple[float, float]:
    """One control call (`GET /weight_info`) through `HTTPClient` and through a bare
    `httpx.Client` (what `HTTPClient` used before 2026-12-06), median of 200 each."""
    client = wtransfer.HTTPClient(url)
    ours = median_seconds(client.get_weight_version, 200)
    client.close()
    with httpx.Client(base_url=url, timeout=60) as http:
        bare = median_seconds(lambda: http.get("/weight_info").json(), 200)
    return ours, bare


def over_http(model_name: str, repeats: int, tp: int) -> tuple[float, float, float, float]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "wtransfer", "serve", "--model", model_name,
                               "--port", str(port), "--dev-mode",
                               "--tensor-parallel-size", str(tp)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
            if time.monotonic() > deadline:
                raise SystemExit("server did not start")
        update = update_seconds(wtransfer.HTTPClient(url), model_name, repeats)
        call, httpx_call = control_call_seconds(url)
        body = {"sampling_params": {"max_tokens": TOKENS, "temperature": 0}}
        with httpx.Client(base_url=url, timeout=300) as http, ThreadPoolExecutor(REQUESTS) as pool:
            start = time.perf_counter()
            list(pool.map(lambda i: http.post("/inference/v1/generate",
                                              json={**body, "token_ids": [i + 1, 2, 3]}),
                          range(REQUESTS)))
            gen = time.perf_counter() - start
    finally:
        server.terminate()
        server.wait(timeout=60)
    return update, gen, call, httpx_call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="tiny,small")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--tp", type=int, default=1, help="the engine's tensor-parallel workers")
    args = parser.parse_args()
    rows = []
    for name in args.models.split(","):
        local_update, local_gen = in_process(name, args.repeats, args.tp)
        http_update, http_gen, call, httpx_call = over_http(name, args.repeats, args.tp)
        params = sum(p.numel() for p in load_model(name).parameters())
        rows.append({"model": name, "params": params, "update_local_ms": local_update * 1e3,
                     "update_http_ms": http_update * 1e3,
                     "http_overhead_ms": (http_update - local_update) * 1e3,
                     "tok_s_local": REQUESTS * TOKENS / local_gen,
                     "tok_s_http": REQUESTS * TOKENS / http_gen,
                     "call_ms": call * 1e3, "httpx_call_ms": httpx_call * 1e3})
    print(f"\nweight update (ipc) and generation ({REQUESTS} x {TOKENS} tokens), TP={args.tp}, "
          f"median of {args.repeats}")
    print_table(rows, [("model", "model", ""), ("params", "params", ","),
                       ("update_local_ms", "update in-proc ms", ".2f"),
                       ("update_http_ms", "update HTTP ms", ".2f"),
                       ("http_overhead_ms", "HTTP overhead ms", ".2f"),
                       ("tok_s_local", "gen tok/s in-proc", ".0f"),
                       ("tok_s_http", "gen tok/s HTTP", ".0f"),
                       ("call_ms", "control call ms", ".3f"),
                       ("httpx_call_ms", "same through httpx ms", ".3f")])
    print(f"wrote {write_json('http', rows, vars(args))}")


if __name__ == "__main__":
    main()
