#!/usr/bin/env bash
# Isolated venv for upstream Medusa's PyPI package (medusa-llm), used by
# scripts/interop/fixtures_medusa.py and scripts/interop/check_medusa.py.
# Idempotent: re-running only installs what is missing.
#
# medusa-llm 0.1 requires fschat, torch, transformers, accelerate, sentencepiece, protobuf (all
# unpinned).  Its model code (medusa.model.medusa_model / modeling_llama_kv / kv_cache / utils) is a
# copy of transformers v4.31's Llama and needs only torch, transformers 4.x, safetensors and
# huggingface_hub, so the package goes in with --no-deps and only those are installed
# (fschat / sentencepiece / protobuf / accelerate are for its CLI and trainer).
# transformers 4.31.0 is the release its modeling_llama_kv.py says it was copied from.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
VENV="$ROOT/.venv-interop/medusa"
PY="${PYTHON:-python3.11}"

TORCH=torch==2.13.0
MEDUSA=medusa-llm==0.1
TRANSFORMERS=transformers==4.31.0
TOKENIZERS=tokenizers==0.13.3
HUB=huggingface_hub==0.16.4
SAFETENSORS=safetensors==0.4.5
NUMPY=numpy==1.26.4

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP="nice -n 10 $VENV/bin/pip install --disable-pip-version-check -q"
$PIP "$TORCH"
$PIP "$NUMPY" "$SAFETENSORS" "$HUB" "$TOKENIZERS" packaging pyyaml regex requests tqdm filelock
$PIP --no-deps "$TRANSFORMERS" "$MEDUSA"
"$VENV/bin/python" - <<'PY'
import importlib.metadata as md
import torch, transformers
import medusa.model.medusa_model, medusa.model.modeling_llama_kv  # noqa: F401
print({n: md.version(n) for n in ("medusa-llm", "torch", "transformers", "safetensors")})
PY
