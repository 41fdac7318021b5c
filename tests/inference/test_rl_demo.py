"""The main job in a reduced configuration: validation passes, versions advance every step."""

import json

import pytest

from wtransfer.demos.rl.demo import run_rl_demo
from wtransfer.demos.rl.task import ChainParityTask
from wtransfer.errors import ConfigError


def test_reduced_demo_validates_and_labels_every_update(tmp_path, capsys):
    code = run_rl_demo(steps=3, prompts_per_step=4, group=4, run_dir=str(tmp_path))
    printed = capsys.readouterr().out
    assert code == 0, printed
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["summary"]["validation_passed"] is True
    assert [s["version"] for s in metrics["steps"]] == ["step-0", "step-1", "step-2"]
    assert (tmp_path / "rl.png").stat().st_size > 10_000
    assert "mid-flight keep requests checked against a fresh engine: 6, mismatches: 0" in printed


@pytest.mark.extended  # its mechanics: tests/inference/test_fleet.py, test_pd.py
def test_reduced_demo_on_a_fleet_kills_an_instance_and_a_new_one_joins(tmp_path, capsys):
    """`--engines 2`: two servers updated as one; mid-run one is SIGKILLed and a replacement
    joins from the other with the current version; the next update drops the dead one and
    reaches the new one; validation passes."""
    code = run_rl_demo(steps=4, prompts_per_step=4, group=4, run_dir=str(tmp_path), fleet=2)
    out = capsys.readouterr().out
    assert code == 0, out
    assert "fleet: killed instance http://127.0.0.1:" in out
    assert "joined from http://127.0.0.1:" in out and "at 'step-2'" in out
    assert "fleet: 2 instance(s) at 'step-3'; dropped HTTPClient(" in out
    assert "validation                         PASSED" in out


@pytest.mark.extended  # its mechanics: tests/inference/test_fleet.py, test_pd.py
def test_reduced_demo_on_a_prefill_and_a_decode_instance(tmp_path, capsys):
    """`--pd`: a prefill and a decode instance updated as one; requests decode from handed-
    over K/V; the validation (mid-flight tokens, fingerprints of both) passes."""
    code = run_rl_demo(steps=2, prompts_per_step=4, group=4, run_dir=str(tmp_path), pd=True)
    out = capsys.readouterr().out
    assert code == 0, out
    remote = int(out.split("P/D: ")[1].split(" request(s) decoded")[0])
    assert remote > 0, out
    assert "validation                         PASSED" in out


@pytest.mark.extended  # the demo's loop as above; data-parallel updates over HTTP: test_http.py
def test_reduced_demo_on_a_data_parallel_server(tmp_path, capsys):
    code = run_rl_demo(steps=2, prompts_per_step=4, group=4, run_dir=str(tmp_path),
                       data_parallel_size=2)
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "2 data-parallel ranks" in printed
    assert "mid-flight keep requests checked against a fresh engine: 6, mismatches: 0" in printed


def test_reduced_demo_trained_by_two_fsdp2_ranks(tmp_path, capsys):
    code = run_rl_demo(steps=2, local=True, prompts_per_step=4, group=4, run_dir=str(tmp_path),
                       trainer_ranks=2)
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "trained by 2 FSDP2 ranks" in printed
    assert "mid-flight keep requests checked against a fresh engine: 6, mismatches: 0" in printed


def test_reduced_demo_trains_and_sends_only_a_lora_adapter(tmp_path, capsys):
    from wtransfer.demos.rl.lora import ADAPTER, LORA_ALPHA, LORA_RANK, add_adapters
    from wtransfer.inference.model.decoder import load_model
    from wtransfer.trainer.lora import LoRASource

    code = run_rl_demo(steps=2, local=True, prompts_per_step=4, group=4, run_dir=str(tmp_path),
                       lora=True)
    printed = capsys.readouterr().out
    assert code == 0, printed
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    policy = load_model("tiny", seed=0)
    layers = policy.config.num_hidden_layers
    assert add_adapters(policy, LORA_RANK, LORA_ALPHA, seed=0) == 7 * layers
    adapter = LoRASource(ADAPTER, policy, lora_alpha=LORA_ALPHA)
    adapter_kib = sum(m.nbytes for m in adapter.metadata()) / 1024
    assert [s["moved_kib"] for s in metrics["steps"]] == [adapter_kib, adapter_kib]
    assert [s["version"] for s in metrics["steps"]] == ["step-0", "step-1"]
    assert f"only it moves: {adapter_kib:.1f} KiB per update" in printed
    assert "mid-flight keep requests checked against a fresh engine: 6, mismatches: 0" in printed


@pytest.mark.parametrize(("options", "message"), [
    ({"lora": True, "engine": "vllm"}, "--lora runs with our engine"),
    ({"lora": True, "trainer_ranks": 2}, "drop --trainer-ranks"),
    ({"lora": True, "update_staging": "off"}, "--lora needs staged updates"),
    ({"delta": True, "trainer_ranks": 2}, "--delta sends from one unsharded trainer"),
])
def test_demo_options_it_cannot_run_are_refused_before_anything_starts(options, message,
                                                                      tmp_path):
    with pytest.raises(ConfigError, match=message):
        run_rl_demo(steps=1, run_dir=str(tmp_path), **options)
    assert not any(tmp_path.iterdir())  # nothing ran


def test_chain_parity_reward_is_exact():
    task = ChainParityTask(vocab_size=256)
    assert task.reward([3], [200, 10, 11]) == 1.0   # odd→high, even→low, even→low
    assert task.reward([3], [10, 200, 11]) == pytest.approx(1 / 3)  # only 11 after 200
    assert task.reward([4], [10, 11, 250]) == 1.0
    assert task.reward([4], []) == 0.0
