"""ModuleTarget: checks everything before writing anything; writes in place."""

import pytest
import torch
from wtransfer_ipc import IPCTrainerInitInfo

import wtransfer
from wtransfer.errors import MetadataError
from wtransfer.packing import TensorMeta
from wtransfer.shapes import build_module


def small_model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def test_wrong_shape_is_refused_before_any_weight_changes():
    engine_model = small_model(0)
    before = {k: v.clone() for k, v in engine_model.state_dict().items()}
    target = wtransfer.ModuleTarget(engine_model)
    metas = [TensorMeta("0.weight", "float32", (16, 8)), TensorMeta("2.weight", "float32", (4, 17))]
    with pytest.raises(MetadataError, match=r"'2.weight': sent float32\[4, 17\], engine holds "
                                            r"float32\[4, 16\]"):
        target.check(metas)
    trainer = build_module(metas, seed=5)
    engine = wtransfer.create_receiver("ipc", target)
    sender = wtransfer.trainer_init(IPCTrainerInitInfo(bucket_bytes=4096),
                                    client=wtransfer.LocalClient(engine),
                                    source=wtransfer.ModuleSource(trainer))
    with pytest.raises(MetadataError, match="refused before any weight changed"):
        sender.send_weights()
    after = engine_model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert engine.state == "failed" and engine.torn is False
    sender.shutdown()
    engine.shutdown()


def test_load_is_in_place_and_name_map_and_post_process_apply():
    trainer = small_model(1)
    engine_model = small_model(2)
    pointers = [p.data_ptr() for p in engine_model.parameters()]
    calls = []
    target = wtransfer.ModuleTarget(
        engine_model, name_map=lambda n: n.replace("layer_a.", "0.").replace("layer_b.", "2."),
        post_process=lambda m: calls.append(type(m).__name__))
    engine = wtransfer.create_receiver("ipc", target)
    source = wtransfer.ModuleSource(
        trainer, name_map={"0.weight": "layer_a.weight", "0.bias": "layer_a.bias",
                           "2.weight": "layer_b.weight", "2.bias": "layer_b.bias"})
    with wtransfer.trainer_init(IPCTrainerInitInfo(bucket_bytes=1024),
                                client=wtransfer.LocalClient(engine), source=source) as sender:
        sender.send_weights()
    assert wtransfer.fingerprint(trainer.state_dict()) == target.fingerprint()
    assert [p.data_ptr() for p in engine_model.parameters()] == pointers
    assert calls == ["Sequential"]
    engine.shutdown()


def test_unknown_names_are_listed():
    target = wtransfer.ModuleTarget(small_model(0))
    with pytest.raises(MetadataError, match=r"unknown tensor 'nope\.weight'"):
        target.check([TensorMeta("nope.weight", "float32", (1,))])


def test_a_list_checked_before_is_checked_again_against_what_the_module_holds_now():
    module = torch.nn.Linear(4, 3)
    target = wtransfer.ModuleTarget(module)
    source = wtransfer.ModuleSource(torch.nn.Linear(4, 3))
    metas = source.metadata()
    target.check(metas)
    target.check(metas)  # the same list again: still fine
    module.weight.data = torch.zeros(3, 5)  # the engine resized a parameter in place
    with pytest.raises(MetadataError, match=r"'weight': sent float32\[3, 4\], engine holds "
                                            r"float32\[3, 5\]"):
        target.check(metas)
    module.weight.data = torch.zeros(3, 4, dtype=torch.float64)
    with pytest.raises(MetadataError, match="engine holds float64"):
        target.check(metas)


def test_a_source_reports_a_tensor_that_changed_shape_since_the_last_update():
    module = torch.nn.Linear(4, 3)
    source = wtransfer.ModuleSource(module)
    assert source.metadata()[0].shape == (3, 4)
    module.weight.data = torch.zeros(3, 6)
    assert source.metadata()[0].shape == (3, 6)
    module.weight.data = torch.zeros(3, 6, dtype=torch.float16)
    assert source.metadata()[0].dtype == "float16"


def test_a_source_offers_its_tensors_in_place_in_metadata_order():
    module = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    source = wtransfer.ModuleSource(module, names=["1.bias", "0.weight"])
    held = source.held()
    assert [m.name for m in source.metadata()] == ["1.bias", "0.weight"]
    assert [t.data_ptr() for t in held] == [module[1].bias.data_ptr(),
                                            module[0].weight.data_ptr()]
    assert [t.data_ptr() for _, t in source.tensors()] == [t.data_ptr() for t in held]
