"""One planning question end to end: a model, a trainer layout, an engine layout and a
cluster -> the plan the transports would run and what the simulator predicts for it."""

from __future__ import annotations

import time
from dataclasses import dataclass

from wtransfer.errors import ConfigError
from wtransfer.packing import DTYPES, TensorMeta
from wtransfer.shapes import MODEL_SHAPES, qwen3_metas
from wtransfer.sim.cluster import Cluster
from wtransfer.sim.layouts import engine_layouts, trainer_layouts
from wtransfer.sim.models import SCALE_MODELS, scale_metas
from wtransfer.sim.simulate import Prediction, simulate
from wtransfer.transport.m2n import TransferPlan, plan_transfers

FP8 = "float8_e4m3fn"


def model_tensors(name: str) -> list[TensorMeta]:
    """A large model of `wtransfer.sim.models` or a Qwen3 dense list of `wtransfer.shapes`."""
    if name in SCALE_MODELS:
        return scale_metas(name)
    if name in MODEL_SHAPES:
        return qwen3_metas(**MODEL_SHAPES[name])  # type: ignore[arg-type]
    raise ConfigError(f"unknown model {name!r}; choose one of "
                      f"{sorted([*SCALE_MODELS, *MODEL_SHAPES])}")


def as_engine_dtype(metas: list[TensorMeta], dtype: str) -> list[TensorMeta]:
    """The tensors as the engine holds them: ``bf16`` unchanged; ``fp8``: every projection
    weight (attention, MLP, experts) in float8_e4m3fn, the rest (embedding, head, norms,
    routers) as they are (block scales, 1/16384 of the weights' bytes, left out)."""
    if dtype in ("bf16", "bfloat16"):
        return metas
    if dtype != "fp8":
        raise ConfigError(f"engine dtype {dtype!r}: choose bf16 or fp8")
    return [TensorMeta(m.name, FP8, m.shape) if m.name.endswith("proj.weight")
            and len(m.shape) == 2 else m for m in metas]


@dataclass
class Scenario:
    """A plan and its prediction, with how long planning took."""

    model: str
    plan: TransferPlan
    prediction: Prediction
    model_bytes: int
    """The trainer's bytes (what one full copy in its dtype holds)."""
    engine_bytes: int
    """One full copy in the engine's dtype."""
    plan_seconds: float


def plan_cluster(model: str, *, trainer: str, trainer_gpus: int, replicas: int, tp: int,
                 ep: bool, cluster: Cluster, engine_dtype: str = "bf16",
                 bucket_bytes: int = 1 << 30, num_buffers: int = 2,
                 control_s: float = 0.002) -> Scenario:
    """Plan `model` from `trainer_gpus` ranks laid out as `trainer` into `replicas` x `tp`
    workers with the same planner the transports run, and simulate it on `cluster`."""
    start = time.perf_counter()
    source = model_tensors(model)
    metas = as_engine_dtype(source, engine_dtype)
    plan = plan_transfers(metas, trainer_layouts(source, trainer, trainer_gpus),
                          engine_layouts(metas, replicas, tp, ep), bucket_bytes)
    planned = time.perf_counter() - start
    ratio = [DTYPES[a.dtype].itemsize / DTYPES[b.dtype].itemsize
             for a, b in zip(source, metas, strict=True)]
    prediction = simulate(plan, metas, cluster, num_buffers=num_buffers,
                          source_bytes_per_byte=ratio, control_s=control_s)
    return Scenario(model, plan, prediction, sum(m.nbytes for m in source),
                    sum(m.nbytes for m in metas), planned)
