"""`wtransfer demo --engine vllm`: the async-RL demo with vLLM serving the policy passes its
own validation (mid-flight keep requests against the final weights, fingerprints)."""

import pytest

pytest.importorskip("vllm", reason="vllm is not installed here; `make test-vllm` runs these")

from wtransfer.demos.rl.demo import run_rl_demo


def test_the_rl_demo_runs_on_vllm_and_validates(tmp_path, capsys):
    assert run_rl_demo(steps=3, engine="vllm", run_dir=str(tmp_path)) == 0
    out = capsys.readouterr().out
    assert "validation                         PASSED" in out
    assert "mismatches: 0" in out
