"""Soak: pause / update / resume cycles under generation load against `wtransfer serve`.

    python benchmarks/soak.py --cycles 1000 [--model tiny] [--new-sender-every 10]

Every 100 cycles it prints the server's resident memory, open file descriptors and the
wtransfer segments in /dev/shm, so a leak shows as a column that keeps growing. Not in CI.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import torch
from wtransfer_ipc import IPCTrainerInitInfo

import wtransfer
from wtransfer.inference import load_model
from wtransfer.launch.processes import free_port


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def shm_segments() -> tuple[int, int]:
    names = [n for n in os.listdir("/dev/shm") if n.startswith("wtransfer_")]
    return len(names), sum(os.path.getsize(os.path.join("/dev/shm", n)) for n in names)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cycles", type=int, default=1000)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--load-threads", type=int, default=8)
    parser.add_argument("--new-sender-every", type=int, default=10)
    args = parser.parse_args()
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "wtransfer", "serve", "--port", str(port),
                               "--model", args.model, "--dev-mode"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    client = wtransfer.HTTPClient(url, timeout_s=60)
    deadline = time.monotonic() + 120
    while True:
        try:
            client.is_paused()
            break
        except wtransfer.errors.WTransferError:
            if time.monotonic() > deadline:
                sys.exit("server did not start")
            time.sleep(0.2)
    stop = threading.Event()
    finished = {"requests": 0, "lost": 0}

    def load() -> None:
        with httpx.Client(base_url=url, timeout=120) as http:
            while not stop.is_set():
                r = http.post("/inference/v1/generate", json={
                    "token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 64}})
                body = r.json()
                finished["requests"] += 1
                if r.status_code != 200 or body["choices"][0]["finish_reason"] != "length":
                    finished["lost"] += 1

    threads = [threading.Thread(target=load, daemon=True) for _ in range(args.load_threads)]
    for t in threads:
        t.start()
    model = load_model(args.model, seed=7)
    sender = None
    print(f"{'cycle':>6} {'rss MB':>8} {'fds':>5} {'shm segs':>8} {'shm MB':>7} "
          f"{'requests':>9} {'lost':>5} {'cycle ms':>9}")
    started = time.perf_counter()
    try:
        for cycle in range(1, args.cycles + 1):
            if sender is None or cycle % args.new_sender_every == 0:
                if sender is not None:
                    sender.shutdown()
                sender = wtransfer.trainer_init(IPCTrainerInitInfo(bucket_bytes=1 << 20),
                                                client=client,
                                                source=wtransfer.ModuleSource(model))
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1e-3)
            client.pause("keep")
            sender.send_weights(weight_version=f"v{cycle}")
            client.resume()
            if cycle % 100 == 0 or cycle == 1:
                segs, shm_bytes = shm_segments()
                ms = (time.perf_counter() - started) / cycle * 1e3
                print(f"{cycle:>6} {rss_mb(server.pid):>8.1f} "
                      f"{len(os.listdir(f'/proc/{server.pid}/fd')):>5} {segs:>8} "
                      f"{shm_bytes / 1e6:>7.1f} {finished['requests']:>9} "
                      f"{finished['lost']:>5} {ms:>9.1f}", flush=True)
        same = client.fingerprint() == wtransfer.fingerprint(model.state_dict())
        print(f"fingerprints equal after {args.cycles} cycles: {same}")
    finally:
        stop.set()
        if sender is not None:
            sender.shutdown()
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)


if __name__ == "__main__":
    main()
