#!/usr/bin/env bash
# Isolated venv for upstream EAGLE's PyPI package (eagle-llm), used by
# scripts/interop/fixtures_eagle.py and scripts/interop/check_eagle.py.
# Idempotent: re-running only installs what is missing.
#
# eagle-llm 1.2.1 pins accelerate==0.21.0, fschat==0.2.31, gradio==3.50.2, openai, anthropic,
# sentencepiece==0.1.99, protobuf==3.19.0, wandb and an unpinned torch/transformers.  Its model
# code (eagle.model.cnets / ea_model / modeling_llama_kv / modeling_mixtral_kv, eagle.modeling_eagle)
# only needs torch, transformers 4.x (>= 4.36: MoeCausalLMOutputWithPast), safetensors and
# huggingface_hub, so the package goes in with --no-deps and only those are installed.
# accelerate 0.21.0 (its own pin) is added because its training script saves the draft with
# Accelerator.save_state, which the fixture generator uses.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
VENV="$ROOT/.venv-interop/eagle"
PY="${PYTHON:-python3.11}"

TORCH=torch==2.13.0
EAGLE=eagle-llm==1.2.1
TRANSFORMERS=transformers==4.36.2
TOKENIZERS=tokenizers==0.15.2
HUB=huggingface_hub==0.20.3
SAFETENSORS=safetensors==0.4.5
ACCELERATE=accelerate==0.21.0
NUMPY=numpy==1.26.4

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP="nice -n 10 $VENV/bin/pip install --disable-pip-version-check -q"
$PIP "$TORCH"
$PIP "$NUMPY" "$SAFETENSORS" "$HUB" "$TOKENIZERS" packaging pyyaml regex requests tqdm filelock psutil
$PIP --no-deps "$TRANSFORMERS" "$ACCELERATE" "$EAGLE"
"$VENV/bin/python" - <<'PY'
import importlib.metadata as md
import torch, transformers
import eagle.model.cnets, eagle.model.ea_model, eagle.modeling_eagle, eagle.modelbsne1.cnets  # noqa: F401
print({n: md.version(n) for n in ("eagle-llm", "torch", "transformers", "accelerate", "safetensors")})
PY
