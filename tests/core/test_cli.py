"""The command line: backends table and the two-process transfer demo."""

import asyncio
import subprocess
import sys

import pytest

from wtransfer.cli import build_parser
from wtransfer.errors import ConfigError
from wtransfer.inference import AsyncEngine, EngineConfig, SamplingParams


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


def test_version_help_and_demo_argument_errors_are_one_clear_line():
    """--version answers; every serve flag has help with its default; the help text carries
    no reStructuredText markup; a bad demo argument is a usage error, not a traceback."""
    version = run("--version")
    assert version.returncode == 0 and version.stdout.startswith("wtransfer 0.")
    top = run("--help").stdout
    assert "``" not in top
    serve = run("serve", "--help").stdout
    for flag in ("--model", "--port", "--device", "--weight-transfer-backend",
                 "--max-num-batched-tokens", "--update-rollback", "--data-parallel-size"):
        assert flag in serve, flag
    assert serve.count("(default:") >= 15
    assert "ucx" in run("demo", "--help").stdout
    for args, message in ((("--steps", "0"), "--steps: must be at least 1"),
                          (("--backend", "foo"), "invalid choice: 'foo'")):
        out = run("demo", *args, timeout=60)
        assert out.returncode == 2 and message in out.stderr, out.stderr
        assert "Traceback" not in out.stderr


def test_serve_takes_the_step_budget_and_names_the_real_ceiling():
    """--max-num-batched-tokens reaches the engine: its admission error names the ceiling of
    this prompt under the flag's value."""
    args = build_parser().parse_args(["serve", "--max-num-batched-tokens", "64"])

    async def admit():
        engine = AsyncEngine(EngineConfig(model="tiny",
                                          max_num_batched_tokens=args.max_num_batched_tokens))
        try:
            async for _ in engine.generate([1, 2, 3], SamplingParams(max_tokens=100_000_000)):
                pass
        finally:
            engine.shutdown()

    with pytest.raises(ConfigError, match="at most 62 fit, bounded by max_num_batched_tokens"):
        asyncio.run(admit())


@pytest.mark.parametrize("flags, says", [
    (["--bucket-mb", "0"], "--bucket-mb: must be at least 1, got 0"),
    (["--bucket-mb", "-5"], "--bucket-mb: must be at least 1, got -5"),
    (["--num-buffers", "0"], "--num-buffers: must be at least 1"),
    (["--hbm-gbps", "nan"], "--hbm-gbps: must be a finite number above 0, got nan"),
    (["--trainer", "megatron:tp=0,pp=1"], "tp must be >= 1"),
    (["--trainer", "megatron:tq=2"], "unknown key(s) ['tq']"),
    (["--trainer", "fsdp:tp=2"], "fsdp takes no options"),
    (["--engine", "1x2ep"], "this model is dense; drop 'ep'"),
    (["--one-gpu", "packed"], "--one-gpu packed: one engine replica (and one trainer rank"),
    (["--one-gpu", "rdma"], "--one-gpu: invalid choice: 'rdma'"),
    (["--one-gpu", "host", "--h2d-gbps", "0"], "--h2d-gbps: must be a finite number above 0"),
])
def test_plan_refuses_every_bad_input_in_one_line_at_once(flags, says, capsys):
    """Each planner input is checked before planning: exit 2 with a one-line reason (a zero
    bucket size used to plan forever, growing memory; nan printed bare NaN in the JSON)."""
    from wtransfer.cli import build_parser
    from wtransfer.errors import WTransferError

    args = ["plan", "--model", "qwen3-8b", "--trainer-gpus", "2", "--engine", "1x2", *flags,
            "--json"]
    try:  # what `wtransfer` does: argparse exits 2; a WTransferError is one line, exit 2
        parsed = build_parser().parse_args(args)
        parsed.func(parsed)
    except SystemExit as exited:
        assert exited.code == 2
        said = capsys.readouterr().err
    except WTransferError as exc:
        said = str(exc)
    else:
        pytest.fail(f"plan took {flags}")
    assert says in said and "\n" not in said.strip().splitlines()[-1], said
    assert capsys.readouterr().out == ""


def test_connections_to_the_serve_listener_send_without_nagles_delay():
    """uvicorn serves `wtransfer serve`'s own listener; asyncio turns Nagle's algorithm off on
    its connections only when the listener names TCP (else every response's body waited for
    the client's delayed ACK of its headers: ~40 ms a call)."""
    import socket

    from wtransfer.cli import _listen

    async def accepted_nodelay() -> int:
        listener = _listen("127.0.0.1", 0)
        seen: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        class Probe(asyncio.Protocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                sock = transport.get_extra_info("socket")
                seen.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
                transport.close()

        server = await asyncio.get_running_loop().create_server(Probe, sock=listener)
        try:
            _, writer = await asyncio.open_connection(*listener.getsockname()[:2])
            try:
                return await asyncio.wait_for(seen, 10)
            finally:
                writer.close()
        finally:
            server.close()

    assert asyncio.run(accepted_nodelay()) != 0
