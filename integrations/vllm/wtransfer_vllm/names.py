"""Names shared by the vLLM side and the trainer side (no vLLM import here)."""

BACKEND_PREFIX = "wtransfer-"
"""vLLM weight-transfer backend ``wtransfer-<name>`` is wtransfer backend ``<name>``."""
WORKER_EXTENSION = "wtransfer_vllm.worker.WorkerExtension"
"""vLLM's ``worker_extension_cls`` that adds the fingerprint and state calls to each worker."""
FINGERPRINT_METHOD = "wtransfer_fingerprint"
STATE_METHOD = "wtransfer_state"
ROLLBACK_METHOD = "wtransfer_rollback"


STAGED_SUFFIX = "-staged"
"""``wtransfer-<name>-staged``: updates loaded into a shadow of the model while vLLM generates,
live at finish."""


def vllm_backend_name(backend: str, *, staged: bool = False) -> str:
    """The vLLM backend name of wtransfer backend `backend` (its shadow-staged engine)."""
    name = backend if backend.startswith(BACKEND_PREFIX) else BACKEND_PREFIX + backend
    return name + STAGED_SUFFIX if staged and not name.endswith(STAGED_SUFFIX) else name
