#!/usr/bin/env bash
# Isolated venv for the `speculators` consumer (vLLM's speculative-decoding format library).
# Idempotent: re-running only installs what is missing.
#
# Pins (recorded 2026, newest 0.9 release on PyPI at the time):
#   speculators   0.9.0   (requires torch<=2.14.1,>=2.9.0, transformers<=5.19.0,>=5.0.0,
#                          and torchvision + torchaudio, which it never imports for the model
#                          classes; installed with --no-deps so no CUDA torch is pulled)
#   hs-connectors 0.9.0   (speculators pins ==0.9.0; imported only by its training code)
#   torch         2.13.0  (CPU build, installed first)
#   transformers  5.19.0  (newest allowed by speculators' pin)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="$ROOT/.venv-interop/speculators"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null 2>&1 || PY=python3

SPECULATORS_VERSION=0.9.0
HS_CONNECTORS_VERSION=0.9.0
TORCH_VERSION=2.13.0
TRANSFORMERS_VERSION=5.19.0

if [ ! -x "$VENV/bin/python" ]; then
  mkdir -p "$(dirname "$VENV")"
  "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check -q)

# 1. torch first (CPU build from local disk).
"${PIP[@]}" "torch==$TORCH_VERSION"

# 2. speculators' runtime deps by hand (its METADATA, minus torchvision/torchaudio/CUDA extras).
"${PIP[@]}" \
  "transformers==$TRANSFORMERS_VERSION" \
  "datasets>=4.0.0,<=5.1.0" \
  "loguru>=0.7.2,<=0.7.3" \
  "numpy>=2.0.0,<=2.5.4" \
  "tqdm>=4.66.3,<=4.70.1" \
  "pydantic>=2.0.0" "pydantic-settings>=2.0.0" \
  "openai>=2.0.0" "typer>=0.12.0" \
  aiohttp click httpx huggingface-hub protobuf psutil rich safetensors

# 3. the packages themselves, without their pins (they would pull torchvision/torchaudio).
"${PIP[@]}" --no-deps "hs-connectors==$HS_CONNECTORS_VERSION" "speculators==$SPECULATORS_VERSION"

"$VENV/bin/python" - <<'PY'
import importlib.metadata as md
for name in ("speculators", "hs-connectors", "torch", "transformers", "safetensors", "pydantic", "huggingface-hub"):
    print(f"{name}=={md.version(name)}")
import speculators  # noqa: F401  (import check)
from speculators.models.eagle3 import Eagle3DraftModel  # noqa: F401
print("speculators import ok")
PY
