#!/usr/bin/env bash
# llama.cpp's libllama as a shared library, for the llama.cpp target backend
# (inference/llamacpp/, docs/llamacpp-backend.md). Built once, CPU only, tuned to this CPU
# (GGML_NATIVE), from the same pinned llama-cpp-python sdist as scripts/interop/setup_llamacpp.sh
# (llama.cpp commit 0c1e570). Without a compiler the engine keeps its torch path.
#
# Output: $DEST/lib/libllama.so (+ libggml*.so beside it) and our shim libdrafthead_llama.so;
# `drafthead` finds them there, or wherever DRAFTHEAD_LIBLLAMA points. llama.cpp's own plain and
# speculative tools (llama-completion, llama-speculative-simple) are built against the same
# library for `drafthead bench --compare llama.cpp`, and its OpenAI-compatible llama-server (no
# web UI) for `data regenerate --server` (tests/test_server_regenerate.py). About 8 minutes on 2 cores, once;
# idempotent: a second run only checks the build is current.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
DEST="${DEST:-$ROOT/build/libllama}"
PY="${PYTHON:-python3}"
JOBS="${JOBS:-2}"
LCP_VERSION=0.3.36
SDIST="llama_cpp_python-$LCP_VERSION.tar.gz"
SDIST_SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e

mkdir -p "$DEST"
cd "$DEST"
if [ ! -f "$SDIST" ]; then
    "$PY" -m pip download --disable-pip-version-check -q --no-deps --no-binary :all: \
        "llama-cpp-python==$LCP_VERSION" -d "$DEST"
fi
echo "$SDIST_SHA256  $SDIST" | sha256sum -c - >/dev/null
SRC="$DEST/llama_cpp_python-$LCP_VERSION/vendor/llama.cpp"
[ -f "$SRC/include/llama.h" ] || tar xzf "$SDIST"

GEN=()
command -v ninja >/dev/null && GEN=(-G Ninja)
if [ ! -f "$DEST/cmake/CMakeCache.txt" ]; then
    cmake -S "$SRC" -B "$DEST/cmake" "${GEN[@]}" \
        -DCMAKE_BUILD_TYPE=Release \
        -DBUILD_SHARED_LIBS=ON \
        -DGGML_NATIVE=ON \
        -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF \
        -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_TOOLS=ON \
        -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_COMMON=ON \
        -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF >/dev/null
fi
nice -n 10 cmake --build "$DEST/cmake" --config Release -j "$JOBS" \
    --target llama llama-completion llama-speculative-simple llama-server
mkdir -p "$DEST/lib"
find "$DEST/cmake/bin" "$DEST/cmake/src" "$DEST/cmake/ggml" -name 'lib*.so*' -exec cp -P {} "$DEST/lib/" \; 2>/dev/null || true
cp "$SRC/include/llama.h" "$DEST/lib/"
# the plain-argument wrappers (inference/llamacpp/shim.cpp), linked against the libllama beside them
g++ -O2 -std=c++17 -shared -fPIC "$ROOT/inference/llamacpp/shim.cpp" -I "$SRC/include" -I "$SRC/src" -I "$SRC/ggml/include" \
    -L "$DEST/lib" -lllama -Wl,-rpath,'$ORIGIN' -o "$DEST/lib/libdrafthead_llama.so"
# llama.cpp's own HF -> GGUF converter (inference/llamacpp/convert.py runs it)
rm -rf "$DEST/converter" && mkdir -p "$DEST/converter"
cp -r "$SRC/convert_hf_to_gguf.py" "$SRC/gguf-py" "$DEST/converter/"
[ -d "$SRC/conversion" ] && cp -r "$SRC/conversion" "$DEST/converter/"
ls "$DEST/lib"
echo "libllama: $DEST/lib/libllama.so"
