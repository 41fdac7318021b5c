"""wtransfer inside vLLM: every installed wtransfer backend becomes a vLLM weight-transfer engine
named ``wtransfer-<backend>`` (registered in every vLLM process by the `vllm.general_plugins`
entry point), and trainer-side `WeightSyncClient`s drive a real vLLM engine: `AsyncLLMClient`
in process, `ServerClient` over `vllm serve`.

    args = AsyncEngineArgs(model=path, **wtransfer_vllm.engine_kwargs("ipc"))
    llm = AsyncLLM.from_engine_args(args)
    sender = wtransfer.trainer_init(IPCTrainerInitInfo(), client=AsyncLLMClient(llm),
                                    source=wtransfer.ModuleSource(hf_model))
"""

from typing import Any

from wtransfer_vllm.clients import AsyncLLMClient, ServerClient
from wtransfer_vllm.lora import adapter_id, lora_request
from wtransfer_vllm.names import BACKEND_PREFIX, WORKER_EXTENSION, vllm_backend_name


def engine_kwargs(backend: str, *, staged: bool = False) -> dict[str, Any]:
    """The vLLM engine arguments that serve wtransfer backend `backend`: the weight-transfer
    config, and the worker extension that lets clients read fingerprints. With `staged`,
    updates load into a shadow of the model's layers while vLLM generates and go live between
    two steps (`wtransfer_vllm.staging`); ``send_weights(..., pause="keep")`` pauses only
    around that commit."""
    return {"weight_transfer_config": {"backend": vllm_backend_name(backend, staged=staged)},
            "worker_extension_cls": WORKER_EXTENSION}


__all__ = ["BACKEND_PREFIX", "WORKER_EXTENSION", "AsyncLLMClient", "ServerClient",
           "adapter_id", "engine_kwargs", "lora_request", "vllm_backend_name"]
