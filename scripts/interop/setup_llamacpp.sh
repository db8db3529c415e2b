#!/usr/bin/env bash
# Isolated llama.cpp for the interop checks (scripts/interop/check_llamacpp.py,
# scripts/interop/fixtures_llamacpp.py).
#
# llama.cpp has no release on PyPI of its own; its C++ source and its Python converter
# (convert_hf_to_gguf.py + conversion/ + gguf-py/) ship vendored inside the llama-cpp-python sdist,
# which is what we pin (sdist sha256 below). The sdist ships the submodule's shallow git metadata
# (.git/modules/vendor/llama.cpp), so llama.cpp's build-info reads it: the vendored llama.cpp is
# commit 0c1e57098bba43ac29e6e3b677cdceebdd22334f (2026-10-01, "webgpu: fix SSM_SCAN binding aliasing
# (#29750)"); `--version` prints "0.5.0-dev (build 1, commit 0c1e570)" (build 1: shallow clone).
#
# Builds (Release, CPU only, static libs, no curl/openssl, no web UI):
#   llama-speculative-simple  greedy speculative decoding; accepts --spec-type draft-eagle3
#                             (common/arg.cpp "--spec-type", LLAMA_EXAMPLE_SPECULATIVE)
#   llama-completion          plain greedy generation (the baseline)
#   llama-tokenize            token ids of a prompt (to check llama.cpp tokenizes the chat text as HF does)
# Set LLAMACPP_TARGETS to build others (e.g. "llama-server llama-cli", both also take --spec-type).
#
# Python venv (converter deps): torch 2.13.0 (CPU, from local disk), numpy 2.2.6 and protobuf <5
# (the converter's own pins, requirements/requirements-convert_legacy_llama.txt), sentencepiece
# (imported by the converter even for BPE vocabularies), safetensors, and the vendored gguf-py
# installed from the tree (gguf 0.19.0). The converter's requirements pin torch==2.11.0 (a CUDA
# download here) and transformers==4.57.6; 4.x has no TokenizersBackend class, which our target's tokenizer_config.json
# names ("tokenizer_class": "TokenizersBackend", written by transformers 5), so transformers 5.24.0 (the
# version our own venv uses, and so the same chat-template rendering) is installed instead.
# Idempotent: re-running skips the download/unpack/build/installs that are already done.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
BASE="$ROOT/.venv-interop/llamacpp"
PY="${PYTHON:-python3.11}"

LCP_VERSION=0.3.36
SDIST="llama_cpp_python-$LCP_VERSION.tar.gz"
SDIST_SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
SRC="$BASE/llama_cpp_python-$LCP_VERSION/vendor/llama.cpp"
BUILD="$BASE/build"
VENV="$BASE/venv"
TARGETS="${LLAMACPP_TARGETS:-llama-speculative-simple llama-completion llama-tokenize}"
JOBS="${JOBS:-2}"

TORCH=torch==2.13.0
NUMPY=numpy==2.2.6
SENTENCEPIECE=sentencepiece==0.2.1
TRANSFORMERS=transformers==5.24.0
PROTOBUF=protobuf==4.25.8

mkdir -p "$BASE"
cd "$BASE"

# 1. source
if [ ! -f "$SDIST" ]; then
    "$PY" -m pip download --disable-pip-version-check -q --no-deps --no-binary :all: \
        "llama-cpp-python==$LCP_VERSION" -d "$BASE"
fi
echo "$SDIST_SHA256  $SDIST" | sha256sum -c -
[ -f "$SRC/convert_hf_to_gguf.py" ] || tar xzf "$SDIST"

# 2. build
if [ ! -f "$BUILD/CMakeCache.txt" ]; then
    nice -n 10 cmake -S "$SRC" -B "$BUILD" -G Ninja \
        -DCMAKE_BUILD_TYPE=Release \
        -DBUILD_SHARED_LIBS=OFF \
        -DGGML_NATIVE=ON \
        -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF \
        -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF \
        -DLLAMA_BUILD_TESTS=OFF \
        -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF
fi
# shellcheck disable=SC2086
nice -n 10 cmake --build "$BUILD" --config Release -j "$JOBS" --target $TARGETS

# 3. converter venv
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP="nice -n 10 $VENV/bin/pip install --disable-pip-version-check -q"
have() { "$VENV/bin/python" -c "import importlib.metadata as m,sys; sys.exit(m.version('$1')!='$2')" 2>/dev/null; }
have torch 2.13.0 || $PIP "$TORCH"
have transformers 5.24.0 || $PIP "$NUMPY" "$SENTENCEPIECE" "$PROTOBUF" "$TRANSFORMERS" safetensors
have gguf 0.19.0 || $PIP "$SRC/gguf-py"

# 4. record versions
"$VENV/bin/python" - "$SRC" "$BUILD" <<'PY'
import importlib.metadata as md, subprocess, sys, json, pathlib
src, build = sys.argv[1], sys.argv[2]
v = {n: md.version(n) for n in ("torch", "transformers", "numpy", "sentencepiece", "gguf", "safetensors")}
out = subprocess.run([f"{build}/bin/llama-speculative-simple", "--version"], capture_output=True, text=True)
v["llama.cpp --version"] = (out.stdout + out.stderr).strip().splitlines()
v["llama-cpp-python sdist"] = "0.3.36"
print(json.dumps(v, indent=1))
pathlib.Path(build, "versions.json").write_text(json.dumps(v, indent=1))
PY
