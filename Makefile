# Every target sets up .venv itself. torch is pinned to the CPU wheel so no CUDA build is pulled.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
BACKENDS := $(filter-out backends/ucx,$(wildcard backends/*))
UCX_EXTRA ?= cu12
STAMP := $(VENV)/.installed

.PHONY: setup test demo lint bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml $(wildcard backends/*/pyproject.toml) Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "setuptools>=68" wheel
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q --no-build-isolation -e ".[serve,demo,test,dev]" $(foreach b,$(BACKENDS),-e $(b)) \
		-e "backends/ucx[$(UCX_EXTRA)]"
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q

demo: $(STAMP)
	$(PY) -m wtransfer demo

lint: $(STAMP)
	$(VENV)/bin/ruff check wtransfer backends tests benchmarks examples
	$(VENV)/bin/mypy wtransfer backends/*/wtransfer_* benchmarks examples/inline_backend/wtransfer_inline

bench: $(STAMP)
	$(PY) benchmarks/transfer.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
