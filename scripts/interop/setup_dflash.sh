#!/usr/bin/env bash
# Isolated venv for z-lab's `dflash` package (DFlash's reference inference code: DFlashDraftModel
# and dflash_generate). Idempotent: re-running only installs what is missing.
#
# Pins (recorded 2026-12): dflash 0.1.0, whose `local` extra pins torch 2.13.0 and
# transformers 5.15.0 on Linux; torch is installed first so the CPU build from local disk is used.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="$ROOT/.venv-interop/dflash"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null 2>&1 || PY=python3

if [ ! -x "$VENV/bin/python" ]; then
  mkdir -p "$(dirname "$VENV")"
  "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check -q)
"${PIP[@]}" "torch==2.13.0"
"${PIP[@]}" "dflash[local]==0.1.0"

"$VENV/bin/python" - <<'PY'
import importlib.metadata as md
for name in ("dflash", "torch", "transformers", "safetensors"):
    print(f"{name}=={md.version(name)}")
from dflash.model import DFlashDraftModel, dflash_generate  # noqa: F401  (import check)
print("dflash import ok")
PY
