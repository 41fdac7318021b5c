"""Whole updates (zero-copy, M->N read in place) replay their copies as one CUDA graph from
their second run on: the weights land bit-exact update after update, a NaN that the graph
copies is refused naming its tensor and rolled back, and a program whose sources changed is
worked out and captured again. GPU only: a host device copies eagerly."""

import pytest
import torch

from wtransfer.errors import NonFiniteError
from wtransfer.packing import TensorMeta, byte_view
from wtransfer.receiver.copy_graph import CopyGraph
from wtransfer.receiver.programs import PiecePrograms
from wtransfer.receiver.session import UpdateSession
from wtransfer.receiver.target import ModuleTarget

SHAPES = {"big": ((1024, 1024), torch.bfloat16),  # checked as it copies
          "wide": ((512, 1024), torch.float32),
          "norm": ((64,), torch.float16),  # small: copied in one launch, then watched
          "steps": ((300_000,), torch.int64)}  # large, no exponent rule: a plain memcpy


def values(step: int) -> dict[str, torch.Tensor]:
    """The trainer's tensors at `step` (on the GPU)."""
    generator = torch.Generator().manual_seed(step)
    return {name: (torch.randint(0, 1 << 40, shape, generator=generator) if dtype == torch.int64
                   else torch.randn(shape, generator=generator).to(dtype)).cuda()
            for name, (shape, dtype) in SHAPES.items()}


@pytest.mark.gpu
def test_whole_updates_replay_their_copies_as_one_graph_bit_exact_and_checked():
    pytest.importorskip("triton", reason="the checked copy needs Triton")
    module = torch.nn.Module()
    for name, (shape, dtype) in SHAPES.items():
        module.register_parameter(name, torch.nn.Parameter(
            torch.zeros(shape, dtype=dtype, device="cuda"), requires_grad=False))
    target = ModuleTarget(module)
    start = values(0)
    metas = [TensorMeta.of(name, t) for name, t in start.items()]
    sources = [byte_view(start[m.name]).clone() for m in metas]  # the sender's memory
    programs, store = PiecePrograms(), {}

    def update(step: int, nan: str | None = None) -> UpdateSession:
        sent = values(step)
        if nan is not None:
            sent[nan].view(-1)[7] = float("nan")
        for meta, src in zip(metas, sources, strict=True):  # rewritten in place
            src.copy_(byte_view(sent[meta.name]))
        session = UpdateSession(target, "cuda", programs=programs, rollback=store)
        session.announce(metas)
        session.load_whole(sources)
        return session

    def graph() -> object:
        (program,) = programs.whole_programs()
        return program.graph

    for step in range(1, 4):
        update(step).finish()
        assert all(torch.equal(getattr(module, n), t) for n, t in values(step).items()), step
        assert (graph() is None) == (step == 1), step  # eager first, then captured
    captured = graph()
    assert isinstance(captured, CopyGraph) and captured.verified
    assert captured.checked == ["big", "wide"]
    for name in ("big", "norm"):  # one checked by its copy, one watched after it
        session = update(4, nan=name)
        with pytest.raises(NonFiniteError, match=f"'{name}' holds NaN"):
            session.finish()
        session.rollback()
        assert all(torch.equal(getattr(module, n), t) for n, t in values(3).items()), name
    update(4).finish()  # (each replay zeroes the flags: clean values pass)
    assert all(torch.equal(getattr(module, n), t) for n, t in values(4).items())
    assert graph() is captured  # (the same copies, replayed)

    sources = [s.clone() for s in sources]  # the sender's storages moved: worked out anew
    update(5).finish()
    assert graph() is None
    update(6).finish()
    assert isinstance(graph(), CopyGraph) and graph() is not captured
    assert all(torch.equal(getattr(module, n), t) for n, t in values(6).items())
