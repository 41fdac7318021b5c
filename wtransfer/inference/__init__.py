"""The inference engine: a Qwen3-style decoder with paged KV cache, prefix caching and a
scheduler that owns pause/resume, so weights can change while requests are in flight."""

from wtransfer.inference.async_engine import AsyncEngine, LocalEngineClient
from wtransfer.inference.config import MODEL_CONFIGS, EngineConfig, ModelConfig
from wtransfer.inference.model import Qwen3ForCausalLM, load_model, save_pretrained
from wtransfer.inference.outputs import CompletionOutput, RequestOutput, WeightVersionSpan
from wtransfer.inference.params import SamplingParams
from wtransfer.inference.scheduler import PauseState
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
