"""The inference engine: a Qwen3-style decoder with paged KV cache, prefix caching and a
scheduler that owns pause/resume, so weights can change while requests are in flight.

Packaged by layer: `model/` (the decoder and its layers), `steps/` (the step loop), `updates/`
(weight updates inside the engine), `serving/` (HTTP, P/D), `tp/` and `dp/`; docs/architecture.md
draws them. Modules that lived at this package's root before import from their old names too,
with a `DeprecationWarning` (`_moved.MOVED`).
"""

from wtransfer.inference import _moved

_moved.install()

# ruff: noqa: E402  (the finder above goes in before the engine's own imports)

from wtransfer.inference.async_engine import AsyncEngine, LocalEngineClient
from wtransfer.inference.config import MODEL_CONFIGS, EngineConfig, ModelConfig
from wtransfer.inference.model.decoder import Qwen3ForCausalLM, load_model, save_pretrained
from wtransfer.inference.outputs import CompletionOutput, RequestOutput, WeightVersionSpan
from wtransfer.inference.params import SamplingParams
from wtransfer.inference.steps.scheduler import PauseState
from wtransfer.records import PAUSE_MODES, PauseMode

__all__ = [
    "MODEL_CONFIGS",
    "PAUSE_MODES",
    "AsyncEngine",
    "CompletionOutput",
    "EngineConfig",
    "LocalEngineClient",
    "ModelConfig",
    "PauseMode",
    "PauseState",
    "Qwen3ForCausalLM",
    "RequestOutput",
    "SamplingParams",
    "WeightVersionSpan",
    "load_model",
    "save_pretrained",
]
