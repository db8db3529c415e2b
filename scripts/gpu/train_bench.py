"""The GPU check's training and bench (scripts/gpu/check.sh): an EAGLE-3 head trained for a few
minutes on a target of SmolLM2-135M's shapes with random weights (the staged config; see
scripts/gpu/stage.py for why no weights), then benched against plain decoding on the same target.

    python scripts/gpu/train_bench.py --stage .gpu --work /tmp/gpu-check --minutes 3

A pilot of a few steps prices a step; the run then takes as many steps as fit `--minutes`. Prints
one JSON line: seconds per step and tokens/s of training, the bench's tokens/s, tau and identical
share, and the device. `--dry-run`: a few steps of short rows and a short bench, on whatever
device this machine has (the CPU in CI).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path


def drafthead(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "drafthead", *args], check=True)


def last_train_row(run: Path) -> dict:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r.get("split") == "train"][-1]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stage", default=".gpu")
    p.add_argument("--work", required=True)
    p.add_argument("--minutes", type=float, default=3.0, help="training time after the pilot")
    p.add_argument("--max-length", type=int, default=2048)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--dry-run", action="store_true")
    args = p.parse_args(argv)
    if args.dry_run:
        args.max_length, args.batch_size, args.prompts, args.max_new_tokens, args.minutes = 64, 2, 1, 8, 0.0

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    stage, work = Path(args.stage), Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    target = work / "target"
    config = AutoConfig.from_pretrained(stage / "smollm2")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(target)
    for file in (stage / "smollm2").iterdir():  # tokenizer and chat template beside the weights
        if not (target / file.name).exists():
            shutil.copy(file, target / file.name)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    common = [
        "--config",
        "eagle3",
        f"target={target}",
        "target_dtype=bfloat16",
        "features.mode=online",
        "data.source=json",
        f"data.path={stage / 'chats.jsonl'}",
        f"data.max_length={args.max_length}",
        f"batch_size={args.batch_size}",
        "grad_accum=1",
        "replay.sequences=0",
        "keep_best=none",
        "eval_every=0",
        "checkpoint_every=0",
        "log_every=1",
        "report_to=none",
        "warmup_steps=1",
    ]
    start = time.perf_counter()
    steps = 1  # the dry run: one step, no pilot
    if not args.dry_run:
        drafthead("train", *common, "max_steps=10", f"output_dir={work / 'pilot'}")
        steps = max(10, int(args.minutes * 60 / last_train_row(work / "pilot")["s_step"]))
    drafthead("train", *common, f"max_steps={steps}", f"output_dir={work / 'run'}")
    train_seconds = time.perf_counter() - start
    trained = last_train_row(work / "run")
    drafthead(
        "bench",
        "--target",
        str(target),
        "--head",
        str(work / "run" / "final"),
        "--dataset",
        str(stage / "prompts.jsonl"),
        "--limit",
        str(args.prompts),
        "--max-new-tokens",
        str(args.max_new_tokens),
        "--dtype",
        "bfloat16",
        "--out",
        str(work / "bench.json"),
        "--markdown",
        str(work / "bench.md"),
        "--no-progress",
    )
    bench = json.loads((work / "bench.json").read_text())
    summary = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "steps": steps,
        "s_step": trained["s_step"],
        "train_tokens_per_s": trained["tokens_per_s"],
        "loss": trained["loss"],
        "acc_0": trained.get("acc_0"),
        "train_wall_s": round(train_seconds, 1),
        "bench": {k: bench.get(k) for k in ("tokens_per_s", "baseline_tokens_per_s", "speedup", "tau", "identical_fraction")},
    }
    print(json.dumps(summary), flush=True)
    (work / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
