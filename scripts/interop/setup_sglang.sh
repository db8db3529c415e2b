#!/usr/bin/env bash
# Isolated venv for the SGLang interop harness (scripts/interop/check_sglang.py).
#
# SGLang's server needs CUDA; on CPU we only import its EAGLE model files
# (sglang/srt/models/llama_eagle3.py, llama_eagle.py, llama.py) and their weight loaders.
# So sglang goes in with --no-deps, torch stays the local CPU build (sglang 0.5.23 pins
# torch==2.14.1, a multi-GB CUDA build), and we add by hand only the packages that
# `import sglang.srt.models.llama_eagle3` needs. Every pip call carries a constraint file
# that pins torch, so no dependency can drag a CUDA torch in.
#
# torchvision is NOT installed: the PyPI wheel is built against CUDA torch and fails to load
# its ops on torch 2.13.0+cpu ("operator torchvision::nms does not exist"). sglang only needs
# it for multimodal configs imported by sglang/srt/configs/__init__.py; check_sglang.py
# installs an import stub for it (see _install_import_stubs there), and one for `vllm`, whose
# rotary kernel llama.py's RotaryEmbedding imports (never calls) off CUDA.
#
# Idempotent: re-running reuses the venv; pip skips what is already satisfied.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
VENV="$ROOT/.venv-interop/sglang"
PY="${PYTHON:-python3.11}"

TORCH_VERSION=2.13.0
SGLANG_VERSION=0.5.23
# transformers: the version sglang 0.5.23 pins (Requires-Dist: transformers==5.19.0).
# The rest: exactly the modules the model files' import chain asked for, at the versions
# resolved when this was written (sentencepiece / compressed-tensors / apache-tvm-ffi at
# sglang's own pins).
DEPS=(
  "transformers==5.19.0"
  "safetensors==0.8.0"
  "numpy==2.4.6"
  "orjson==3.13.0"
  "psutil==7.2.2"
  "pybase64==1.5.1"
  "requests==2.34.2"
  "pillow==13.0.0"
  "starlette==1.10.0"
  "msgspec==0.23.0"
  "pyzmq==27.3.0"
  "ipython==9.18.1"
  "aiohttp==3.14.5"
  "dill==0.4.1"
  "sentencepiece==0.2.1"
  "compressed-tensors==0.18.0"
  "gguf==0.19.0"
  "apache-tvm-ffi==0.1.11"
  "openai==2.8.0"
  "partial_json_parser==0.2.1.1.post7"
  "einops==0.8.2"
)

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIN="$VENV/torch-constraint.txt"
echo "torch==$TORCH_VERSION" > "$PIN"
PIP="nice -n 10 $VENV/bin/python -m pip install --disable-pip-version-check -q -c $PIN"
$PIP "torch==$TORCH_VERSION"
$PIP --no-deps "sglang==$SGLANG_VERSION"
# triton: imported unconditionally by sglang/srt/utils/common.py; the CPU torch wheel
# does not bring it. --no-deps so it cannot touch torch.
$PIP --no-deps "triton==3.9.0"
$PIP "${DEPS[@]}"
# Must stay absent (see above); harmless if it is not there.
"$VENV/bin/python" -m pip uninstall -y -q torchvision 2>/dev/null || true
"$VENV/bin/python" - <<'PY'
import importlib.metadata as md
import torch
assert torch.__version__.startswith("2.13.0"), torch.__version__
print("torch", torch.__version__, "sglang", md.version("sglang"), "transformers", md.version("transformers"))
PY
