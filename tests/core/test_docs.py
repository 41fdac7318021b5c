"""Every Python code block in docs/ runs: the blocks of one page form one program, in order."""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[2] / "docs"
PAGES = sorted(p for p in DOCS.glob("*.md") if "```python" in p.read_text())


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_python_blocks_of_the_page_run(page, tmp_path):
    if "from vllm" in page.read_text() and importlib.util.find_spec("vllm") is None:
        pytest.skip("the page runs vLLM, which is not installed here; `make test-vllm` runs it")
    blocks = re.findall(r"```python\n(.*?)```", page.read_text(), re.S)
    script = tmp_path / f"doc_{page.stem.replace('-', '_')}.py"
    script.write_text("\n\n".join(blocks))
    out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                         text=True, timeout=240, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert out.returncode == 0, f"{page.name}:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"


def test_every_doc_page_with_code_is_covered():
    names = {p.name for p in PAGES}
    assert {"async-rl.md", "backends.md", "http.md", "inference.md",
            "writing-a-backend.md", "vllm.md", "ray.md", "sharded-trainers.md"} <= names
