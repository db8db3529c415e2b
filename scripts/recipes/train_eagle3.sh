#!/usr/bin/env bash
# Reproducible recipe for an EAGLE-3 head of a built-in target (smollm2-135m by default) on a 2-core CPU:
#   1. self-distillation: the target re-answers ShareGPT first turns (its own distribution)
#   2. mix in original ShareGPT first turns (scripts/recipes/mix_data.py)
#   3. capture the target's features once (low/mid/high layers + final state) to disk
#   4. train EAGLE-3 on them (training-time test), bf16 autocast, 2 threads
#   5. continue training from that head (`init_from`, same seed so the same eval split) with a fresh warmup
#      and a lower peak lr (CONTINUE_STEPS=0 skips it)
#   6. save the final head in bf16 with its drafting settings (`--ship`: into heads/pretrained)
#
#   scripts/recipes/train_eagle3.sh --quick    # ~30 min on 2 cores, regeneration included (docs/training.md)
#   scripts/recipes/train_eagle3.sh --ship     # the shipped head (~2.2 h): see heads/pretrained/README.md
#   CONVS=600 EXTRA=600 STEPS=150 scripts/recipes/train_eagle3.sh   # any other size
#   TARGET=gemma3-270m scripts/recipes/train_eagle3.sh --quick   # another built-in target (`make gemma` first)
# Regeneration resumes (answered ids are skipped); capture and training restart from disk.
# Each phase's wall time is printed and appended to $WORK/times.txt.
set -euo pipefail
cd "$(dirname "$0")/../.."
MODE=${1:-}
TARGET=${TARGET:-smollm2-135m}
if [[ "$MODE" == "--quick" ]]; then
    # sized to fit 30 minutes on 2 cores: ~7 min regeneration, ~6 min capture, ~15 min training
    : "${CONVS:=420}" "${EXTRA:=560}" "${STEPS:=120}" "${MAX_NEW:=256}" "${MAX_LEN:=512}" "${WARMUP:=12}" "${WORK:=runs/eagle3-$TARGET-quick}"
    : "${CONTINUE_STEPS:=0}"
fi
BIN=${BIN:-.venv/bin}
CONVS=${CONVS:-1050}           # ShareGPT conversations to look at for regeneration (long prompts are skipped)
EXTRA=${EXTRA:-1300}           # original ShareGPT first turns mixed in
STEPS=${STEPS:-320}            # optimizer steps (batch 4 x accum 4 sequences)
MAX_NEW=${MAX_NEW:-320}        # regenerated answer length cap
MAX_LEN=${MAX_LEN:-704}        # training sample length cap (tokens)
WARMUP=${WARMUP:-30}           # warmup steps (then cosine)
CONTINUE_STEPS=${CONTINUE_STEPS:-450}  # second run from the first run's head: steps, peak lr 5e-4, warmup 10
THREADS=${THREADS:-2}
WORK=${WORK:-runs/eagle3-$TARGET}
DATA=${DATA:-$WORK/regen.jsonl}
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}  # no spinning threads when a core is shared
mkdir -p "$WORK"
START=$SECONDS
phase() {  # phase NAME COMMAND...: run, then print and record its wall time
    local name=$1 t0=$SECONDS
    shift
    "$@"
    printf '%-12s %5ds  (total %ds)\n' "$name" $((SECONDS - t0)) $((SECONDS - START)) | tee -a "$WORK/times.txt"
}

phase regenerate "$BIN/drafthead" data regenerate --target "$TARGET" --dtype auto --threads "$THREADS" \
    --source sharegpt --limit "$CONVS" --max-turns 1 --max-prompt-tokens 384 --max-new-tokens "$MAX_NEW" \
    --batch-size 48 --temperature 0 --out "$DATA"

phase mix "$BIN/python" scripts/recipes/mix_data.py "$DATA" "$WORK/mix.jsonl" --extra "$EXTRA" --skip "${EXTRA_SKIP:-1500}"

OVERRIDES=("target=$TARGET" data.source=json "data.path=$WORK/mix.jsonl" data.limit=null "data.max_length=$MAX_LEN" data.eval_size=48
           "features.path=$WORK/features" "threads=$THREADS" "run_name=eagle3-$TARGET")
phase capture "$BIN/drafthead" data capture --config configs/eagle3.yaml "${OVERRIDES[@]}"
train_phase() {  # train_phase NAME OUT_DIR STEPS LR WARMUP EVALS [override ...]: one EAGLE-3 run, EVALS evals/checkpoints
    local name=$1 out=$2 steps=$3 lr=$4 warmup=$5 evals=$6
    shift 6
    phase "$name" "$BIN/drafthead" train --config configs/eagle3.yaml "${OVERRIDES[@]}" "$@" \
        "max_steps=$steps" epochs=null head.ttt_steps=3 "lr=$lr" "warmup_steps=$warmup" \
        "eval_every=$((steps / evals))" eval_batches=8 "checkpoint_every=$((steps / evals))" log_every=5 \
        "output_dir=$out" report_to=${REPORT_TO:-wandb}
}
train_phase train "$WORK/train" "$STEPS" 1.0e-3 "$WARMUP" 8
FINAL="$WORK/train/final"
if (( CONTINUE_STEPS > 0 )); then
    # the continued head already unrolls every depth: no progressive ramp again
    train_phase continue "$WORK/continue" "$CONTINUE_STEPS" 5.0e-4 10 6 "init_from=$FINAL" head.ttt_ramp=0
    FINAL="$WORK/continue/final"
fi

phase export "$BIN/drafthead" export "$FINAL" --format ours --dtype bfloat16 --out "$WORK/head-bf16"
# drafter settings measured best for the target's head, where a sweep chose them (heads/pretrained/README.md)
DRAFTING=configs/drafting/$TARGET-eagle3.json
if [[ -f "$DRAFTING" ]]; then cp "$DRAFTING" "$WORK/head-bf16/drafting.json"; fi
echo "head: $WORK/head-bf16   wall time: $((SECONDS - START)) s"
if [[ "$MODE" == "--ship" ]]; then
    rm -rf "heads/pretrained/$TARGET"
    cp -r "$WORK/head-bf16" "heads/pretrained/$TARGET"
    echo "shipped: heads/pretrained/$TARGET ($(du -sh "heads/pretrained/$TARGET" | cut -f1))"
fi
