"""The command line: backends table and the two-process transfer demo."""

import subprocess
import sys


def run(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "wtransfer", *args], capture_output=True,
                          text=True, timeout=timeout)


def test_backends_lists_every_installed_backend_with_availability():
    out = run("backends")
    assert out.returncode == 0, out.stderr
    rows = {line.split()[0]: line.split()[1] for line in out.stdout.splitlines()[1:]}
    assert rows["ipc"] == "yes" and rows["nccl"] == "yes" and "ucx" in rows


def test_transfer_demo_proves_the_weights_landed():
    out = run("transfer-demo", "--model", "mixed", "--rounds", "2", "--bucket-mb", "1")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "fingerprints before transfer: different" in out.stdout
    assert "EQUAL - every tensor is bit-exact" in out.stdout
    assert "engine weight version: step-1" in out.stdout and "demo passed" in out.stdout


def test_serve_explains_a_bad_data_parallel_size_without_a_traceback():
    out = run("serve", "--data-parallel-size", "0", timeout=120)
    assert out.returncode == 2 and "data_parallel_size must be >= 1" in out.stderr
    assert "Traceback" not in out.stderr
