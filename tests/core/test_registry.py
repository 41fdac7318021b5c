"""Backends are found through entry points; a broken or missing plugin breaks nothing else."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import wtransfer
from wtransfer.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def plugin_dir(tmp_path_factory):
    """The example third-party backend and a broken plugin, pip-installed into a temp dir."""
    target = tmp_path_factory.mktemp("site")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
         "--no-index", "--target", str(target),
         str(ROOT / "examples" / "inline_backend"), str(ROOT / "examples" / "broken_backend")],
        check=True, capture_output=True, timeout=300,
    )
    return target


def run_with_plugins(plugin_dir, *args, timeout=300):
    env = {**os.environ, "PYTHONPATH": f"{plugin_dir}{os.pathsep}{ROOT}"}
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_installed_plugin_is_discovered_and_a_broken_one_is_reported(plugin_dir):
    code = ("import json, wtransfer; print(json.dumps({n: [i.available, i.distribution, "
            "i.reason] for n, i in wtransfer.list_backends().items()}))")
    out = run_with_plugins(plugin_dir, "-c", code)
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    assert rows["inline"][:2] == [True, "wtransfer-inline-example"]
    assert rows["ipc"][0] is True
    assert rows["broken"][0] is False and "failed to load" in rows["broken"][2]


def test_third_party_backend_passes_the_shipped_conformance_suite(plugin_dir, tmp_path):
    (tmp_path / "test_inline.py").write_text(
        "from wtransfer.testing.conformance import BackendConformance\n"
        "class TestInline(BackendConformance):\n    backend = 'inline'\n")
    (tmp_path / "test_inline_local.py").write_text(IN_PROCESS_CASE)
    out = run_with_plugins(plugin_dir, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           str(tmp_path / "test_inline.py"), str(tmp_path / "test_inline_local.py"),
                           "-k", "round_trip or lifecycle or bad_init or mismatched or subset "
                                 "or someone_else or in_process")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "8 passed" in out.stdout


IN_PROCESS_CASE = """
import wtransfer
from wtransfer.shapes import randomize
from wtransfer.launch.models import build
from wtransfer_inline import InlineTrainerInitInfo


def test_in_process_client_lands_every_update():
    # the backend calls its client itself: its update calls must follow a confirmed start
    model, engine_model = build("mixed", 1, "cpu"), build("mixed", 2, "cpu")
    engine = wtransfer.create_receiver("inline", wtransfer.ModuleTarget(engine_model))
    client = wtransfer.LocalClient(engine)
    info = InlineTrainerInitInfo(bucket_bytes=1 << 16)
    with wtransfer.trainer_init(info, client=client,
                                source=wtransfer.ModuleSource(model)) as sender:
        for step in range(20):
            randomize(model, seed=step)
            sender.send_weights(weight_version=str(step))
            assert wtransfer.fingerprint(engine_model.state_dict()) == \
                wtransfer.fingerprint(model.state_dict())
    engine.shutdown()
"""


def test_broken_backend_lookup_names_the_problem(plugin_dir):
    out = run_with_plugins(plugin_dir, "-c", "import wtransfer; wtransfer.get_backend('broken')")
    assert out.returncode != 0 and "is broken: failed to load" in out.stderr


def test_unknown_backend_error_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown backend 'nope'; known backends: .*'ipc'"):
        wtransfer.get_backend("nope")


def test_runtime_registration_and_duplicates():
    ipc = wtransfer.get_backend("ipc")
    with pytest.raises(ConfigError, match="already registered"):
        wtransfer.register_backend(ipc)
    alias = wtransfer.Backend(name="ipc-alias", receiver=ipc.receiver, sender=ipc.sender,
                              summary="same as ipc")
    wtransfer.register_backend(alias)
    assert wtransfer.list_backends()["ipc-alias"].available
    assert wtransfer.get_backend("ipc-alias").receiver_class().__name__ == "IPCReceiver"
    with pytest.raises(ConfigError):
        wtransfer.register_backend(alias)
    wtransfer.register_backend(alias, replace=True)


def test_missing_dependency_is_listed_with_its_install_hint_and_refused_on_use():
    ghost = wtransfer.Backend(name="ghost", receiver="ghost_mod:R", sender="ghost_mod:S",
                              requires=("ghost_dependency_xyz",),
                              install_hint="pip install ghost-dependency")
    wtransfer.register_backend(ghost, replace=True)
    row = wtransfer.list_backends()["ghost"]
    assert not row.available and "pip install ghost-dependency" in row.reason
    with pytest.raises(ImportError, match="pip install ghost-dependency"):
        wtransfer.create_receiver("ghost", wtransfer.ModuleTarget(torch.nn.Linear(1, 1)))


def test_refresh_rediscovers_installed_plugins():
    wtransfer.registry.refresh()
    assert {"ipc", "nccl"} <= set(wtransfer.list_backends())


def test_registry_view_is_read_only():
    view = wtransfer.registry.registered_backends()
    with pytest.raises(TypeError):
        view["x"] = wtransfer.get_backend("ipc")  # type: ignore[index]
