#!/usr/bin/env bash
# The GPU run (docs/testing.md "The GPU run"): the command of each of its device calls.
#
#   here:   .venv/bin/python scripts/gpu/stage.py --run    once: the bundle in parts; prints the calls
#   there:  bash scripts/gpu/run.sh    each call carrying .gpu-run/parts/manifest.json and one
#           part: it checks what has arrived and says what to send next; the call that completes the
#           parts unpacks the bundle, installs the wheels and drafthead, checks the recorded steps
#           on tiny targets (tests/test_cuda.py -k captured) and runs scripts/gpu/run.py
#           (about 9 minutes in all), which leaves the head's parts and summary.json in $OUT; a
#           later call with nothing carried runs the phases again on the parts there
#   here:   .venv/bin/python scripts/gpu/check_head.py --parts <files_at>/head --out out/gpu-head
#   CI:     bash scripts/gpu/run.sh --dry-run   all of it on the CPU at a tiny budget, the calls
#           as copies into a folder that stands for the device (tests/test_gpu_check.py)
set -uo pipefail
cd "$(dirname "$0")/../.."
source scripts/gpu/install.sh
OUT_DIR="${OUT:-/tmp/drafthead-gpu-run}"
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1
if [[ "${1:-}" == "--dry-run" ]]; then
    PY="${PYTHON:-.venv/bin/python}"
    HERE="$OUT_DIR/here" DEVICE="$OUT_DIR/device"
    rm -rf "$HERE" "$DEVICE"
    echo "== stage"
    "$PY" scripts/gpu/stage.py --run --out "$HERE" --conversations 8 --no-wheels || exit 1
    for part in $(cd "$HERE/parts" && ls ./*.part* | sort); do
        echo "== call: carry manifest.json, ${part#./}"
        mkdir -p "$DEVICE/parts"
        cp "$HERE/parts/manifest.json" "$HERE/parts/$part" "$DEVICE/parts/"
        "$PY" scripts/gpu/parts.py receive "$DEVICE/parts" "$DEVICE/bundle"
        rc=$?
        (( rc == 0 || rc == 3 )) || exit $rc
    done
    echo "== run (the last call)"
    "$PY" scripts/gpu/run.py --bundle "$DEVICE/bundle" --work "$OUT_DIR/work" --out "$OUT_DIR/back" --budget dry || exit 1
    echo "== check the head here"
    "$PY" scripts/gpu/check_head.py --parts "$OUT_DIR/back/head" --out "$OUT_DIR/checked" --budget dry || exit 1
    exit 0
fi
PY="${PYTHON:-python3}"
PARTS=.gpu-run/parts
BUNDLE=.gpu-run/bundle
"$PY" scripts/gpu/parts.py receive "$PARTS" "$BUNDLE"
rc=$?
(( rc == 3 )) && exit 0  # parts still to come: the lines above say which
(( rc == 0 )) || exit $rc
install "$BUNDLE/wheels" 2>&1 | tee "$OUT_DIR/install.log"
(( PIPESTATUS[0] == 0 )) || exit 1
# the recorded steps against plain greedy decoding on tiny targets first (tests/test_cuda.py):
# whatever it says, the phases run (they fall back to eager steps where a recording fails)
DRAFTHEAD_TEST_DEVICE=cuda timeout 90 "$PY" -m pytest -q -p no:cacheprovider tests/test_cuda.py -k captured 2>&1 | tee "$OUT_DIR/graphs.log"
"$PY" scripts/gpu/run.py --bundle "$BUNDLE" --out "$OUT_DIR" 2>&1 | tee "$OUT_DIR/run.log"
exit "${PIPESTATUS[0]}"
