#!/usr/bin/env bash
# Isolated venv for the SGLang interop harness (scripts/interop/check_sglang.py).
# SGLang's server needs CUDA; on CPU we only import its model + weight-loader code, so the
# package goes in with --no-deps and we add by hand just what its model files import.
# Idempotent: re-running reuses the venv and pip skips what is already satisfied.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
VENV="$ROOT/.venv-interop/sglang"
PY="${PYTHON:-python3.11}"

TORCH_VERSION=2.13.0
SGLANG_VERSION=0.5.23
# --- filled in from what sglang 0.5.23's model files actually import on CPU ---
EXTRA_DEPS=(
  "transformers==5.24.0"
  "safetensors"
  "numpy"
)

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP="nice -n 10 $VENV/bin/python -m pip install --disable-pip-version-check -q"
$PIP "torch==$TORCH_VERSION"
$PIP --no-deps "sglang==$SGLANG_VERSION"
$PIP "${EXTRA_DEPS[@]}"
"$VENV/bin/python" -c "import torch, sglang, transformers; print('torch', torch.__version__, 'sglang', sglang.__version__, 'transformers', transformers.__version__)"
