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
                         text=True, timeout=420,  # a deadline, not a timing: ray.md's
                         env={**os.environ, "PYTHONUNBUFFERED": "1"})  # cluster start took
    # over 240 s once on the 2-core VM while three other workers ran M->N tests
    assert out.returncode == 0, f"{page.name}:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"


def test_every_doc_page_with_code_is_covered():
    names = {p.name for p in PAGES}
    assert {"async-rl.md", "backends.md", "http.md", "inference.md",
            "writing-a-backend.md", "vllm.md", "ray.md", "sharded-trainers.md"} <= names


ROOT = DOCS.parent
INSTALL_PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
OWN_PROJECTS = {"wtransfer": ".", "wtransfer-ipc": "backends/ipc",
                "wtransfer-nccl": "backends/nccl", "wtransfer-ucx": "backends/ucx",
                "wtransfer-vllm": "integrations/vllm"}


def install_lines():
    """Every `pip install ...` the README and docs show, as (page, argument list)."""
    import shlex

    found = []
    for page in INSTALL_PAGES:
        for line in re.findall(r"pip install ([^`\n#]+)", page.read_text()):
            found.append((page.name, shlex.split(line.strip())))
    return found


def test_every_install_line_of_the_docs_works_from_a_clone():
    """The install lines name this repository's projects by path, never by a name no index
    has, and every project they install gets its own wtransfer dependencies from the same
    line (`pip install -e integrations/vllm` alone fails in a fresh venv: it asks the index
    for wtransfer). Then pip resolves each line here without any index."""
    import tomllib

    lines = install_lines()
    assert len(lines) >= 6
    resolved = set()  # a line on several pages resolves once
    for page, args in lines:
        paths = [a.split("[")[0] for a in args if not a.startswith("-") and
                 (a.startswith(".") or "/" in a)]
        names = [a.split("[")[0].split("=")[0] for a in args if not a.startswith("-")
                 and a not in paths and a.split("[")[0] not in paths]
        assert not set(names) & set(OWN_PROJECTS), f"{page}: {args} names a project of this " \
                                                   "repository that no index has"
        for path in paths:
            project = tomllib.loads((ROOT / path / "pyproject.toml").read_text())["project"]
            for dep in project.get("dependencies", []):
                dep_name = re.split(r"[<>=\[ ;]", dep)[0]
                if dep_name in OWN_PROJECTS:
                    assert OWN_PROJECTS[dep_name] in paths, \
                        f"{page}: `pip install {' '.join(args)}` installs {path}, which " \
                        f"needs {dep_name}: add -e {OWN_PROJECTS[dep_name]} to the line"
        if any(a.startswith("torch") for a in args) or not paths or tuple(args) in resolved:
            continue  # torch and plain packages come from the index
        resolved.add(tuple(args))
        out = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-index",
                              "--no-build-isolation", "-q", *args], cwd=ROOT,
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, f"{page}: pip install {' '.join(args)}\n{out.stderr[-2000:]}"


def doc_commands():
    """Every `wtransfer ...` command in a code block of the README and docs, continuation
    lines joined and a trailing comment dropped, as (page, argument list); output lines
    (`wtransfer demo: ...`) are not commands."""
    import shlex

    found = []
    for page in INSTALL_PAGES:
        for block in re.findall(r"```[a-z]*\n(.*?)```", page.read_text(), re.S):
            for line in block.replace("\\\n", " ").splitlines():
                line = line.strip().removeprefix("$ ").removeprefix("python -m ")
                if not line.startswith("wtransfer ") or line.split()[1].endswith(":"):
                    continue
                found.append((page.name, shlex.split(line.split("  #")[0])[1:]))
    return found


def test_every_command_the_docs_show_parses():
    """A reader copies a command from a page: it must be one the CLI takes as written (no
    `[--flag]` synopsis inside a block, no flag it lacks)."""
    from wtransfer.cli import build_parser

    commands = doc_commands()
    assert {args[0] for _, args in commands} >= {"serve", "plan", "demo"}
    for page, args in commands:
        try:
            build_parser().parse_args(args)
        except SystemExit:
            pytest.fail(f"{page}: `wtransfer {' '.join(args)}` is not a command the CLI takes")
