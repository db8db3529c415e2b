#!/usr/bin/env bash
# Reproducible recipe for the EAGLE-3 head of smollm2-135m on a 2-core CPU:
#   1. self-distillation: the target re-answers ShareGPT first turns (its own distribution)
#   2. mix in original ShareGPT first turns (scripts/mix_data.py)
#   3. capture the target's features once (low/mid/high layers + final state) to disk
#   4. train EAGLE-3 on them (training-time test), bf16 autocast, 2 threads
#   5. save the final head in bf16 with its drafting settings (`--ship`: into heads/pretrained)
#
#   scripts/train_eagle3_smollm2.sh --ship     # the shipped head: see heads/pretrained/README.md
#   CONVS=600 EXTRA=600 STEPS=150 scripts/train_eagle3_smollm2.sh   # a smaller run
# Regeneration resumes (answered ids are skipped); capture and training restart from disk.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-.venv/bin}
CONVS=${CONVS:-1050}           # ShareGPT conversations to regenerate (first turns; long prompts are skipped)
EXTRA=${EXTRA:-1300}           # original ShareGPT first turns mixed in
STEPS=${STEPS:-320}            # optimizer steps (batch 4 x accum 4 sequences)
THREADS=${THREADS:-2}
WORK=${WORK:-runs/eagle3-smollm2}
DATA=${DATA:-$WORK/regen.jsonl}
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}  # no spinning threads when a core is shared

"$BIN/drafthead" data regenerate --target smollm2-135m --dtype bfloat16 --threads "$THREADS" \
    --source sharegpt --limit "$CONVS" --max-turns 1 --max-prompt-tokens 384 --max-new-tokens 320 \
    --batch-size 48 --temperature 0 --out "$DATA"

"$BIN/python" scripts/mix_data.py "$DATA" "$WORK/mix.jsonl" --extra "$EXTRA" --skip "${EXTRA_SKIP:-1500}"

OVERRIDES=(data.source=json "data.path=$WORK/mix.jsonl" data.limit=null data.max_length=704 data.eval_size=48
           "features.path=$WORK/features" "threads=$THREADS")
"$BIN/drafthead" data capture --config configs/eagle3.yaml "${OVERRIDES[@]}"
"$BIN/drafthead" train --config configs/eagle3.yaml "${OVERRIDES[@]}" \
    "max_steps=$STEPS" epochs=null head.ttt_steps=3 lr=1.0e-3 warmup_steps=30 \
    eval_every=40 eval_batches=8 checkpoint_every=40 log_every=5 "output_dir=$WORK/train" report_to=${REPORT_TO:-wandb}

"$BIN/drafthead" export "$WORK/train/final" --format ours --dtype bfloat16 --out "$WORK/head-bf16"
# drafter settings measured best for this head on this machine (bench sweep, README "Results")
cp configs/drafting/smollm2-135m-eagle3.json "$WORK/head-bf16/drafting.json"
if [[ "${1:-}" == "--ship" ]]; then
    rm -rf heads/pretrained/smollm2-135m
    cp -r "$WORK/head-bf16" heads/pretrained/smollm2-135m
    echo "shipped: heads/pretrained/smollm2-135m ($(du -sh heads/pretrained/smollm2-135m | cut -f1))"
fi
