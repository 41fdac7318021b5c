"""`WorkerExtension`: vLLM's ``worker_extension_cls`` for wtransfer. It adds methods to
every worker, reached by name through ``collective_rpc`` (no pickle): the fingerprint of what
the worker's wtransfer engine received, its receiver's state, and a staged engine's swap back
to the version before its last commit."""

from __future__ import annotations

from typing import Any

from wtransfer_vllm.engine import WTransferEngine


class WorkerExtension:
    """Mixed into vLLM's worker class by ``worker_extension_cls``."""

    def _wtransfer_engine(self) -> WTransferEngine:
        engine = getattr(self, "weight_transfer_engine", None)
        if not isinstance(engine, WTransferEngine):
            raise RuntimeError("this vLLM worker has no wtransfer engine: start vLLM with "
                               "weight_transfer_config={'backend': 'wtransfer-<name>'}")
        return engine

    def wtransfer_fingerprint(self) -> dict[str, str]:
        """Per-tensor digest, by checkpoint name, of the weights this worker holds."""
        return self._wtransfer_engine().target.fingerprint()

    def wtransfer_state(self) -> dict[str, Any]:
        """This worker's receiver state (state, torn, failure, bytes of the last update)."""
        return self._wtransfer_engine().state()

    def wtransfer_rollback(self) -> int:
        """Make the version before the last staged commit live again (a swap back); how
        many layers changed."""
        return self._wtransfer_engine().rollback()
