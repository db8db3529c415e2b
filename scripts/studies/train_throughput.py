"""Training tokens/s on the machine at hand for 1 and 2 processes, and where a step's time goes.

    .venv/bin/python scripts/studies/train_throughput.py --out out/train-throughput --steps 8 --log-every 2 \
        --max-length 256 --precision auto --target-dtype auto grad_accum=1

Runs the same short EAGLE-3 run (SmolLM2 target, ShareGPT, online features) as one process with
2 threads, as 2 DDP processes with 1 thread each, and as 2 FSDP processes.
It reads each run's metrics.jsonl and prints tokens/s and the seconds per step of every phase
(ground/clock.py PhaseClock). The first log window holds warm-up and is left out.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PHASES = ("data", "target", "head", "backward", "optimizer")


def launch(name: str, processes: int, overrides: list[str], out: Path) -> Path:
    run_dir = out / name
    shutil.rmtree(run_dir, ignore_errors=True)  # metrics.jsonl appends: an old run's rows would mix in
    env = dict(os.environ, WANDB_MODE="disabled", ACCELERATE_USE_CPU="1")
    args = ["--config", overrides[0], *overrides[1:], f"output_dir={run_dir}"]
    if processes == 1:
        cmd = [sys.executable, "-m", "drafthead", "train", *args, "threads=2"]
    else:
        cmd = [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--multi_gpu",
            "--num_processes",
            str(processes),
            "--num_machines",
            "1",
            "--mixed_precision",
            "no",
            "--dynamo_backend",
            "no",
            "-m",
            "drafthead",
            "train",
            *args,
            "threads=1",
        ]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=REPO, env=env, check=True)
    return run_dir


def summary(run_dir: Path) -> dict[str, float]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r.get("split") == "train"][1:]  # drop the warm-up window
    n = len(train)
    return {k: sum(r[k] for r in train) / n for k in ("tokens_per_s", "s_step", *(f"s_{p}" for p in PHASES)) if all(k in r for r in train)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="out/train-throughput")
    parser.add_argument("--config", default="eagle3")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--log-every", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=2, help="per process (2 processes: twice the global batch)")
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--runs", default="1proc,ddp2,fsdp2")
    parser.add_argument("--precision", default="bf16", help="mixed_precision of every run (no: fp32)")
    parser.add_argument("--target-dtype", default="bfloat16")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="more run config overrides")
    args = parser.parse_args()
    out = Path(args.out)
    base = [
        args.config,
        "features.mode=online",
        f"mixed_precision='{args.precision}'",
        f"target_dtype={args.target_dtype}",
        "data.source=sharegpt",
        "data.limit=400",
        f"data.max_length={args.max_length}",
        f"batch_size={args.batch_size}",
        f"max_steps={args.steps}",
        f"log_every={args.log_every}",
        "checkpoint_every=0",
        "eval_every=0",
        "data.eval_size=8",
        "report_to=none",
        *args.overrides,
    ]
    plans = {"1proc": (1, []), "ddp2": (2, ["parallelism=ddp"]), "fsdp2": (2, ["parallelism=fsdp"])}
    results = {}
    for name in args.runs.split(","):
        processes, extra = plans[name]
        results[name] = dict(summary(launch(name, processes, base + extra, out)), processes=processes)
    (out / "summary.json").write_text(json.dumps(results, indent=1))
    print("\n| run | processes | tokens/s | s/step | " + " | ".join(PHASES) + " |")
    print("| --- | ---: | ---: | ---: | " + " | ".join("---:" for _ in PHASES) + " |")
    for name, r in results.items():
        cells = " | ".join(f"{r.get(f's_{p}', float('nan')):.3f}" for p in PHASES)
        print(f"| {name} | {r['processes']} | {r['tokens_per_s']:.0f} | {r['s_step']:.3f} | {cells} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
