#!/usr/bin/env bash
# The GPU check (docs/testing.md "On a GPU"): one command for the device tool, under 8 minutes.
#
#   here:   .venv/bin/python scripts/gpu/stage.py --out .gpu      (once; .gpu is git-ignored)
#   there:  bash scripts/gpu/check.sh            run with carry [".gpu"]; writes to $OUT if set
#   CI:     bash scripts/gpu/check.sh --dry-run  the same steps on the CPU, in make test
#
# 1. installs drafthead (--no-deps) and the staged wheels into the image's Python, offline;
# 2. runs tests/test_cuda.py on the device (tree verify, KV compaction, ragged batches, bf16,
#    a packed training step against the CPU's, the long-context memory bound) and the context-
#    parallel equality test;
# 3. trains an EAGLE-3 head on a target of SmolLM2-135M's shapes for a few minutes and benches it
#    (scripts/gpu/train_bench.py), printing one JSON summary line.
set -euo pipefail
cd "$(dirname "$0")/../.."
DRY=0
[[ "${1:-}" == "--dry-run" ]] && DRY=1
OUT_DIR="${OUT:-/tmp/drafthead-gpu-check}"
mkdir -p "$OUT_DIR"
if [[ $DRY == 1 ]]; then
    PY="${PYTHON:-.venv/bin/python}"
    STAGE="$OUT_DIR/stage"
    "$PY" scripts/gpu/stage.py --out "$STAGE" --chats 32 --no-wheels
    DEVICE=cpu
    TESTS=(tests/test_cuda.py)  # make test runs the context-parallel test itself
    TRAIN_ARGS=(--dry-run)
else
    PY="${PYTHON:-python3}"
    STAGE=.gpu
    [[ -d "$STAGE/wheels" ]] || { echo "no $STAGE/wheels: run scripts/gpu/stage.py here and carry .gpu" >&2; exit 2; }
    "$PY" -m pip install -q --no-deps --no-index --find-links "$STAGE/wheels" "$STAGE"/wheels/*.whl
    "$PY" -m pip install -q --no-deps --no-build-isolation -e .
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
    DEVICE=cuda
    TESTS=(tests/test_cuda.py tests/test_context_parallel.py)
    TRAIN_ARGS=(--minutes "${GPU_TRAIN_MINUTES:-3}")
fi
export PYTHONUNBUFFERED=1
echo "== device tests ($DEVICE)"
DRAFTHEAD_TEST_DEVICE=$DEVICE "$PY" -m pytest -q -p no:cacheprovider "${TESTS[@]}"
echo "== train and bench"
"$PY" scripts/gpu/train_bench.py --stage "$STAGE" --work "$OUT_DIR/work" "${TRAIN_ARGS[@]}"
cp "$OUT_DIR/work/summary.json" "$OUT_DIR/work/bench.md" "$OUT_DIR/" 2>/dev/null || true
