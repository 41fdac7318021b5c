"""The README's smallest complete use runs as written, as two real processes."""

import re
import subprocess
import sys
import textwrap
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"

MODEL = textwrap.dedent("""
    import torch
    torch.manual_seed({seed})
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
""")


def readme_halves():
    block = re.search(r"## The smallest complete use\n\n```python\n(.*?)```", README.read_text(),
                      re.S).group(1)
    engine, trainer = block.split("# trainer side")
    return engine, "# trainer side" + trainer


def test_two_process_example_runs_as_written():
    engine_code, trainer_code = readme_halves()
    engine = subprocess.Popen(
        [sys.executable, "-c", MODEL.format(seed=2) + engine_code
         + "\nimport sys; sys.stdout.flush(); sys.stdin.read(); server.close(); engine.shutdown()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        address = engine.stdout.readline().strip()
        assert address.startswith("tcp://127.0.0.1:")
        trainer = subprocess.run(
            [sys.executable, "-c", MODEL.format(seed=1) + f"address = {address!r}\n"
             + trainer_code + "\nprint('bytes', stats.bytes, 'ok')"],
            capture_output=True, text=True, timeout=120)
        assert trainer.returncode == 0, trainer.stderr
        assert trainer.stdout.split()[-1] == "ok"
        assert int(trainer.stdout.split()[-2]) == (64 * 256 + 256 + 256 * 64 + 64) * 4
    finally:
        engine.stdin.close()
        engine.wait(timeout=30)
