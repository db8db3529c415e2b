#!/usr/bin/env bash
# Reproducible recipe for the EAGLE-3 head of smollm2-135m on a 2-core CPU:
#   1. self-distillation: the target re-answers ShareGPT first turns (its own distribution)
#   2. capture the target's features once (low/mid/high layers + final state) to disk
#   3. train EAGLE-3 on them (training-time test), bf16 autocast, 2 threads
#   4. save the final head in bf16 (`--ship` copies it to heads/pretrained/smollm2-135m)
#
#   scripts/train_eagle3_smollm2.sh            # the quick recipe: ~30 min here
#   CONVS=3000 STEPS=1200 scripts/train_eagle3_smollm2.sh --ship   # the shipped head's recipe
# Every stage resumes: regeneration skips answered ids, capture and training restart from disk.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-.venv/bin}
CONVS=${CONVS:-600}            # conversations to regenerate (first turns)
STEPS=${STEPS:-300}            # optimizer steps (batch 4 x accum 4 sequences)
THREADS=${THREADS:-2}
WORK=${WORK:-runs/eagle3-smollm2}
DATA=${DATA:-$WORK/regen.jsonl}
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}  # no spinning threads when a core is shared

"$BIN/drafthead" data regenerate --target smollm2-135m --dtype bfloat16 --threads "$THREADS" \
    --source sharegpt --limit "$CONVS" --max-turns 1 --max-prompt-tokens 384 --max-new-tokens 320 \
    --batch-size 48 --temperature 0 --out "$DATA"

OVERRIDES=(data.source=regenerated "data.path=$DATA" "data.limit=$CONVS" data.max_length=704
           "features.path=$WORK/features" "threads=$THREADS")
"$BIN/drafthead" data capture --config configs/eagle3.yaml "${OVERRIDES[@]}"
"$BIN/drafthead" train --config configs/eagle3.yaml "${OVERRIDES[@]}" \
    "max_steps=$STEPS" epochs=null head.ttt_steps=5 lr=6.0e-4 warmup_steps=30 \
    eval_every=100 checkpoint_every=100 "output_dir=$WORK/train" report_to=${REPORT_TO:-wandb}

"$BIN/drafthead" export "$WORK/train/final" --format ours --dtype bfloat16 --out "$WORK/head-bf16"
if [[ "${1:-}" == "--ship" ]]; then
    rm -rf heads/pretrained/smollm2-135m
    cp -r "$WORK/head-bf16" heads/pretrained/smollm2-135m
    echo "shipped: heads/pretrained/smollm2-135m ($(du -sh heads/pretrained/smollm2-135m | cut -f1))"
fi
