#!/usr/bin/env bash
# Isolated venv for SpecForge (scripts/interop/fixtures_specforge.py): its EAGLE-3 draft class
# (specforge/modeling/draft/llama3_eagle.py) and exporters (specforge/export/to_sglang.py, to_hf.py).
#
# specforge 0.2.0 pins torch==2.11.0 and sglang==0.5.14 (plus wandb, tensorboard, yunchang, ...):
# none of that is needed to build the draft and export it on the CPU, so specforge goes in with
# --no-deps, torch stays the local CPU build, and only what the draft/export modules import is
# added (transformers at specforge's own pin 5.8.1; safetensors; huggingface_hub comes with
# transformers). Every pip call carries a constraint file pinning torch.
# Idempotent: re-running reuses the venv; pip skips what is already satisfied.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
VENV="$ROOT/.venv-interop/specforge"
PY="${PYTHON:-python3.11}"

TORCH_VERSION=2.13.0
SPECFORGE_VERSION=0.2.0
DEPS=(
  "transformers==5.8.1"      # specforge 0.2.0's Requires-Dist pin
  "huggingface_hub==1.33.0"  # imported by modeling/draft/base.py and export/to_hf.py
  "safetensors==0.8.0"
  "numpy==2.4.6"
)

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIN="$VENV/torch-constraint.txt"
echo "torch==$TORCH_VERSION" > "$PIN"
PIP="nice -n 10 $VENV/bin/python -m pip install --disable-pip-version-check -q -c $PIN"
$PIP "torch==$TORCH_VERSION"
$PIP --no-deps "specforge==$SPECFORGE_VERSION"
$PIP "${DEPS[@]}"
"$VENV/bin/python" - <<'PY'
import importlib.metadata as md
import warnings
warnings.filterwarnings("ignore")
import torch
assert torch.__version__.startswith("2.13.0"), torch.__version__
import specforge.export, specforge.modeling.draft.llama3_eagle  # noqa: F401
print("torch", torch.__version__, "specforge", md.version("specforge"), "transformers", md.version("transformers"))
PY
