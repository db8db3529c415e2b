#!/usr/bin/env bash
# The GPU check (docs/testing.md "On a GPU"): one command for the device tool, under 8 minutes.
#
#   here:   .venv/bin/python scripts/gpu/stage.py --out .gpu      (once; .gpu is git-ignored)
#   there:  bash scripts/gpu/check.sh            run with carry [".gpu"]; writes to $OUT if set
#   CI:     bash scripts/gpu/check.sh --dry-run  steps 3 and 4 on the CPU, in make test
#
# 1. installs drafthead (--no-deps) and the staged wheels into the image's Python, offline;
# 2. runs tests/test_cuda.py on the device (tree verify, KV compaction, ragged batches, bf16,
#    a packed training step against the CPU's, the long-context memory bound) and the context-
#    parallel equality test;
# 3. one EAGLE-3 training step at growing lengths, peak device memory against --plan's
#    (scripts/gpu/long_context.py);
# 4. trains an EAGLE-3 head on a target of SmolLM2-135M's shapes for a few minutes and benches it
#    (scripts/gpu/train_bench.py), printing one JSON summary line.
# Each step runs whatever the one before it gave, so one run reports on all of them; the script
# fails if any did. Logs and results go to $OUT (at most 8 files come back from the device).
set -uo pipefail
cd "$(dirname "$0")/../.."
source scripts/gpu/install.sh
DRY=0
[[ "${1:-}" == "--dry-run" ]] && DRY=1
OUT_DIR="${OUT:-/tmp/drafthead-gpu-check}"
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1
FAILED=()
step() {  # step NAME COMMAND...: run it, its output to the console and $OUT_DIR/NAME.log
    local name=$1
    shift
    echo "== $name ($(date -u +%T))"
    "$@" 2>&1 | tee "$OUT_DIR/$name.log"
    local rc=${PIPESTATUS[0]}
    [[ $rc == 0 ]] || { FAILED+=("$name (exit $rc)"); echo "== $name failed: exit $rc"; }
}
if [[ $DRY == 1 ]]; then
    PY="${PYTHON:-.venv/bin/python}"
    STAGE="$OUT_DIR/stage"
    "$PY" scripts/gpu/stage.py --out "$STAGE" --chats 32 --no-wheels
    DEVICE=cpu
    WORK="$OUT_DIR/work"
    TESTS=()  # make test runs tests/test_cuda.py on the CPU, and the context-parallel test
    DRY_ARGS=(--dry-run)
else
    PY="${PYTHON:-python3}"
    STAGE=.gpu
    [[ -d "$STAGE/wheels" ]] || { echo "no $STAGE/wheels: run scripts/gpu/stage.py here and carry .gpu" >&2; exit 2; }
    step install install "$STAGE/wheels"
    DEVICE=cuda
    WORK=/tmp/drafthead-gpu-work  # the target's weights and checkpoints: too many and too large for $OUT
    TESTS=(tests/test_cuda.py tests/test_context_parallel.py)
    DRY_ARGS=()
fi
(( ${#TESTS[@]} )) && step tests env DRAFTHEAD_TEST_DEVICE=$DEVICE "$PY" -m pytest -q -p no:cacheprovider "${TESTS[@]}"
step long_context "$PY" scripts/gpu/long_context.py --stage "$STAGE" --out "$OUT_DIR/long_context.jsonl" "${DRY_ARGS[@]}"
# the bench: 4 prompts x 96 tokens; the GPU's eager decoding is launch-bound (about 16 tokens/s
# plain, docs/results.md 2026-12-04), so 8 x 128 pushed the whole check past 8 minutes
step train_bench "$PY" scripts/gpu/train_bench.py --stage "$STAGE" --work "$WORK" --minutes "${GPU_TRAIN_MINUTES:-1.5}" \
    --prompts 4 --max-new-tokens 96 "${DRY_ARGS[@]}"
cp "$WORK/summary.json" "$WORK/bench.md" "$OUT_DIR/" 2>/dev/null
if (( ${#FAILED[@]} )); then
    echo "== failed: ${FAILED[*]}"
    exit 1
fi
echo "== all steps passed"
