"""Old module paths of the engine, kept importable with a `DeprecationWarning`.

The engine was packaged by layer (model, steps, updates, serving); `import
wtransfer.inference.replica` still works and gives the module now at
`wtransfer.inference.updates.replica` (`wtransfer.moved`).
"""

from __future__ import annotations

from wtransfer import moved

MOVED: dict[str, str] = {
    "attention": "model.attention",
    "parallel": "model.parallel",
    "experts": "model.experts",
    "fp8_linear": "model.fp8_linear",
    "fp8_matmul": "model.fp8_matmul",
    "scheduler": "steps.scheduler",
    "block_manager": "steps.block_manager",
    "sequence": "steps.sequence",
    "runner": "steps.runner",
    "decode_graphs": "steps.decode_graphs",
    "replica": "updates.replica",
    "staging": "updates.staging",
    "shard_target": "updates.shard_target",
    "transfer_lane": "updates.transfer_lane",
    "stall": "updates.stall",
    "release": "updates.release",
    "lora": "updates.lora",
    "server": "serving.server",
    "http_body": "serving.http_body",
    "disaggregation": "serving.disaggregation",
    "handover": "serving.handover",
    "join": "serving.join",
}
"""Old module name under `wtransfer.inference` -> its path there now."""


def install() -> None:
    """Keeps every old name of `MOVED` importable."""
    moved.install("wtransfer.inference", MOVED)
