"""The import rules docs/architecture.md states, read from the source (every `import` and
`from ... import` at any depth, type-checking blocks included): a change that breaks one fails
here naming the file and the import."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "wtransfer"

ENGINE_LAYERS = {
    "config": 0, "params": 0, "outputs": 0, "commands": 0,
    "model": 1,
    "steps": 2,
    "updates": 3, "tp": 3,
    "engine_core": 4, "dp": 4,
    "async_engine": 5,
    "serving": 6,
}
"""The engine's layers, bottom to top: a module imports its own layer or one below."""

ABOVE_THE_CORE = ("wtransfer.inference", "wtransfer.demos", "wtransfer.ray", "wtransfer.launch",
                  "wtransfer.testing", "wtransfer.cli")
"""What the core (every other module of `wtransfer`) never imports."""


def module_name(path):
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(path):
    """Every absolute module name `path` imports."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


MODULES = {module_name(p): imports(p) for p in sorted(PACKAGE.rglob("*.py"))}


def under(name, *prefixes):
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def engine_layer(name):
    """The layer of a module under `wtransfer.inference` (None: the package itself)."""
    parts = name.split(".")
    return ENGINE_LAYERS[parts[2]] if len(parts) > 2 and parts[2] != "_moved" else None


def broken(rule):
    return [f"{module} imports {target}" for module, targets in MODULES.items()
            for target in sorted(targets) if rule(module, target)]


def test_the_walk_sees_the_tree():
    assert len(MODULES) > 100
    assert "wtransfer.inference.steps.scheduler" in MODULES
    assert "wtransfer.errors" in MODULES["wtransfer.inference.updates.replica"]


def test_the_core_never_imports_the_engine_demos_ray_launch_testing_or_the_cli():
    assert broken(lambda m, t: not under(m, *ABOVE_THE_CORE) and m != "wtransfer.__main__"
                  and under(t, *ABOVE_THE_CORE)) == []


def test_trainer_and_receiver_never_import_each_other():
    assert broken(lambda m, t: (under(m, "wtransfer.trainer") and under(t, "wtransfer.receiver"))
                  or (under(m, "wtransfer.receiver") and under(t, "wtransfer.trainer"))) == []


def test_nothing_in_wtransfer_imports_a_backend():
    assert broken(lambda m, t: under(t, "wtransfer_ipc", "wtransfer_nccl", "wtransfer_ucx")) == []


def test_production_code_never_imports_the_test_harness():
    """The engine, the CLI and the demos never import `wtransfer.testing`; the engine never
    imports `wtransfer.launch` (the demos start child processes through it)."""
    assert broken(lambda m, t: under(m, "wtransfer.inference", "wtransfer.cli",
                                     "wtransfer.demos", "wtransfer.ray")
                  and under(t, "wtransfer.testing")) == []
    assert broken(lambda m, t: under(m, "wtransfer.inference") and under(t, "wtransfer.launch")) \
        == []


BASE = ("wtransfer.errors", "wtransfer.wire", "wtransfer.records", "wtransfer.protocol",
        "wtransfer.manifest", "wtransfer.packing", "wtransfer.copies", "wtransfer.fingerprint",
        "wtransfer.shapes", "wtransfer.moved", "wtransfer.transport.channel",
        "wtransfer.transport.device_kernels", "wtransfer.transport.stacks")
"""The base layer, which everything else builds on: the root's modules below the registry, and
the control channel, the checked device kernels and the stack printer of `transport/`."""

ROOT_MODULES = {"__init__", "__main__", "errors", "wire", "records", "protocol", "manifest",
                "packing", "copies", "fingerprint", "shapes", "moved", "registry", "cli"}
"""The package root: the shared core, the registry, the CLI and the old-names mechanism; the
trainer side, the engine side and the control plane between them (clients, rpc) live in
packages of their own."""


def test_the_base_layer_imports_nothing_above_it():
    """The base modules import one another, never the trainer, the receiver, deltas, the
    clients or anything else built on them."""
    assert broken(lambda m, t: m in BASE and under(t, "wtransfer") and t != "wtransfer"
                  and not under(t, *BASE)) == []


SIDES = ("wtransfer.trainer", "wtransfer.receiver", "wtransfer.registry", "wtransfer.control",
         "wtransfer.quant", "wtransfer.sim")
"""The two sides and what is built on them."""


def test_the_shared_data_plane_and_delta_core_import_neither_side():
    """`transport/` and `delta/` (codec, comparison, pieces) sit below the trainer and the
    receiver: the delta strategies each side holds live beside its base
    (`trainer/deltas.py`, `receiver/deltas.py`), and the data plane never reaches into deltas."""
    assert broken(lambda m, t: under(m, "wtransfer.transport", "wtransfer.delta")
                  and under(t, *SIDES)) == []
    assert broken(lambda m, t: under(m, "wtransfer.transport") and under(t, "wtransfer.delta")) \
        == []


def test_the_package_root_holds_only_the_core_it_lists():
    assert {path.stem for path in PACKAGE.glob("*.py")} == ROOT_MODULES


def test_one_module_speaks_zeromq():
    """`wtransfer.transport.channel` holds every socket of every control channel (rpc, the TP
    workers, the DP ranks); nothing else in `wtransfer` imports ZeroMQ."""
    assert broken(lambda m, t: under(t, "zmq") and m != "wtransfer.transport.channel") == []
    assert any(under(t, "zmq") for t in MODULES["wtransfer.transport.channel"])


def test_the_engines_layers_import_only_their_own_layer_or_below():
    def upward(module, target):
        if not (under(module, "wtransfer.inference") and under(target, "wtransfer.inference")):
            return False
        low, high = engine_layer(module), engine_layer(target)
        return low is not None and high is not None and high > low

    assert broken(upward) == []


@pytest.mark.parametrize(("old", "new"), [
    ("wtransfer.inference.replica", "wtransfer.inference.updates.replica"),
    ("wtransfer.inference.scheduler", "wtransfer.inference.steps.scheduler"),
    ("wtransfer.inference.server", "wtransfer.inference.serving.server"),
    ("wtransfer.inference.lora", "wtransfer.inference.updates.lora"),
    ("wtransfer.transport.mton", "wtransfer.transport.m2n"),
    ("wtransfer_nccl.mton", "wtransfer_nccl.m2n"),
    ("wtransfer_ucx.mton_reads", "wtransfer_ucx.m2n_reads"),
    ("wtransfer.channel", "wtransfer.transport.channel"),
    ("wtransfer.stacks", "wtransfer.transport.stacks"),
    ("wtransfer.device_kernels", "wtransfer.transport.device_kernels"),
    ("wtransfer.delta.sender", "wtransfer.trainer.deltas"),
    ("wtransfer.delta.target", "wtransfer.receiver.deltas"),
    ("wtransfer.transport.copies", "wtransfer.copies"),
    ("wtransfer.clients", "wtransfer.control.clients"),
])
def test_a_module_imported_by_its_old_name_is_the_moved_one_with_a_warning(old, new):
    import importlib
    import sys
    import warnings

    importlib.import_module(old.rpartition(".")[0])  # (the package registers its old names)
    sys.modules.pop(old, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(old)
    moved = importlib.import_module(new)
    assert module is moved and module.__spec__.name == new
    assert [str(w.message) for w in caught if w.category is DeprecationWarning] == [
        f"{old} moved to {new}; import it from there"]


def test_wtransfer_rpc_is_the_control_planes_rpc_under_its_public_name_without_a_warning():
    import importlib
    import subprocess
    import sys

    import wtransfer.control.rpc

    assert importlib.import_module("wtransfer.rpc") is wtransfer.control.rpc
    code = ("import warnings; warnings.simplefilter('error'); "
            "from wtransfer.rpc import ReceiverServer, RPCClient; import wtransfer; "
            "assert wtransfer.rpc.RPCClient is RPCClient")
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0
