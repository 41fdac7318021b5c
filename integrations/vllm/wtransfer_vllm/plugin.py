"""The `vllm.general_plugins` entry point: vLLM runs `register()` in every one of its
processes (the engine is built inside the worker process, so registering in the trainer's
process alone would not do)."""

from __future__ import annotations

import logging

from wtransfer_vllm.names import vllm_backend_name

log = logging.getLogger("wtransfer.vllm")


def register() -> None:
    """Register every installed, available wtransfer backend as ``wtransfer-<name>`` and as
    ``wtransfer-<name>-staged`` (updates staged in host memory until finish)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from wtransfer.registry import list_backends
    from wtransfer_vllm.engine import engine_class

    for name, info in list_backends().items():
        if not info.available:
            log.debug("wtransfer backend %s is unavailable here: %s", name, info.reason)
            continue
        for staged in (False, True):
            vllm_name = vllm_backend_name(name, staged=staged)
            if vllm_name in WeightTransferEngineFactory._registry:  # an earlier call did
                continue
            WeightTransferEngineFactory.register_engine(vllm_name,
                                                        engine_class(name, staged=staged))
