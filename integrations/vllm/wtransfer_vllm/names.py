"""Names shared by the vLLM side and the trainer side (no vLLM import here)."""

BACKEND_PREFIX = "wtransfer-"
"""vLLM weight-transfer backend ``wtransfer-<name>`` is wtransfer backend ``<name>``."""
WORKER_EXTENSION = "wtransfer_vllm.worker.WorkerExtension"
"""vLLM's ``worker_extension_cls`` that adds the fingerprint and state calls to each worker."""
FINGERPRINT_METHOD = "wtransfer_fingerprint"
STATE_METHOD = "wtransfer_state"


def vllm_backend_name(backend: str) -> str:
    """The vLLM backend name of wtransfer backend `backend`."""
    return backend if backend.startswith(BACKEND_PREFIX) else BACKEND_PREFIX + backend
