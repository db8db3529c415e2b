"""Head kinds at the same training budget: tau per CPU-minute (docs/results.md, head kinds at the same budget).

    .venv/bin/python scripts/studies/study_same_budget.py --work runs/study --minutes 7 \
        --kinds eagle3,eagle31,peagle,dflash,medusa1 --prompts 8 --max-new-tokens 128

Needs, under --work, the captured features of one mixed chat file (`features/`, `mix.jsonl`: what
scripts/recipes/train_eagle3.sh's regenerate / mix / capture phases write; every kind reads the
EAGLE-3 capture, which holds layers 2, 15, 27 and the final state). For each kind:

  1. pilot: a few steps to measure seconds per optimizer step on the machine at hand;
  2. train: as many steps as fit `--minutes` (warmup 10%, cosine), evaluating the held-out split 4
     times (per-depth accuracy, tau_est) and saving the final head;
  3. bench: MT-bench first turns, float32, a chain of `--chain` drafts (what the engines serve by
     default), no lookup nodes: tau, per-position acceptance, tokens/s and the draft share of round time.

Writes WORK/study.json, WORK/study.md (the table) and WORK/study.png (held-out tau_est against
training minutes per kind, with each kind's bench tau at its end). Nothing else should run meanwhile:
the budget is wall-clock time on 2 threads.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BIN = ROOT / ".venv" / "bin"

RAMP = 0.5
# kind -> (preset, head overrides): one learning rate for all, EAGLE's TTT shortened as the quick recipe does
KINDS = {
    # the fixed unroll, as the first study ran (the presets now ramp it: eagle3-ramp)
    "eagle3": ("eagle3", ["head.ttt_steps=3", "head.ttt_ramp=0"]),
    "eagle31": ("eagle31", ["head.ttt_steps=3", "head.ttt_ramp=0"]),
    # progressive TTT (a training lever): the unroll grows 1 -> 3 over the first half of the run
    "eagle3-ramp": ("eagle3", ["head.ttt_steps=3", f"head.ttt_ramp={RAMP}"]),
    # an entropy curriculum on top (EDSD's easy-to-hard order, heads/eagle3.py entropy_curriculum)
    "eagle3-edsd": ("eagle3", ["head.ttt_steps=3", f"head.ttt_ramp={RAMP}", f"head.entropy_ramp={RAMP}"]),
    "peagle": ("peagle", []),
    "dflash": ("dflash", []),
    # the objectives on one kind: LK's -log acceptance and D-PACE's adaptive weights
    "dflash-lk": ("dflash", ["head.loss=lk_alpha"]),
    "dflash-dpace": ("dflash", ["head.loss=dpace"]),
    "eagle3-dpace": ("eagle3", ["head.ttt_steps=3", "head.ttt_ramp=0", "head.loss=dpace"]),
    # DSpark: DFlash's backbone and block of 7 with the Markov and confidence heads (the paper's loss)
    "dspark": ("dspark", []),
    "dspark-dpace": ("dspark", ["head.loss=dpace"]),
    "medusa1": ("medusa1", []),
    "hydra": ("hydra", []),
    "eagle1": ("eagle1", []),
    # the target trains too (LoRA), so its features are computed online each step, not read from the capture
    "medusa2": ("medusa2", ["features.mode=online"]),
}
LR = 1.0e-3


def train_overrides(work: Path, out: Path, threads: int) -> list[str]:
    return [
        "data.source=json",
        f"data.path={work / 'mix.jsonl'}",
        "data.limit=null",
        "data.max_length=512",
        "data.eval_size=48",
        f"features.path={work / 'features'}",
        f"threads={threads}",
        f"output_dir={out}",
        "report_to=none",
        "epochs=null",
        f"lr={LR}",
        "replay.sequences=0",
    ]


def run(cmd: list, log: Path) -> float:
    """Run cmd with its output in `log`; returns its wall seconds."""
    start = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.run([str(c) for c in cmd], stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
    if proc.returncode:
        raise SystemExit(f"{cmd[:3]} failed ({proc.returncode}); see {log}:\n{log.read_text()[-1500:]}")
    return time.perf_counter() - start


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def pilot_s_step(name: str, preset: str, head: list[str], args) -> float:
    """Seconds per optimizer step of `preset` with `head` overrides, from 4 steps on the machine at hand."""
    work = Path(args.work)
    pilot = work / f"{name}-pilot"
    common = ["--config", preset, *train_overrides(work, pilot, args.threads), *head]
    run(
        [BIN / "drafthead", "train", *common, "max_steps=4", "log_every=2", "eval_every=1000", "checkpoint_every=1000", "warmup_steps=1"],
        work / f"{name}-pilot.log",
    )
    return [r["s_step"] for r in metrics(pilot) if r.get("split") == "train"][-1]  # the second window: warm


def study_kind(kind: str, args) -> dict:
    preset, head = KINDS[kind]
    # the pilot times the whole unroll: a ramp's shallow steps would leave it mismeasured
    fixed = ["head.ttt_ramp=0" if h.startswith("head.ttt_ramp=") else h for h in head]
    if args.steps:  # the same number of optimizer steps for every kind (the budget in steps, not minutes)
        return study_steps(kind, preset, head, args.steps, None, args)
    s_step = pilot_s_step(kind, preset, fixed, args)
    if any(h.startswith("head.ttt_ramp=") and float(h.split("=", 1)[1]) > 0 for h in head):
        # progressive TTT: depth d (1..3) takes RAMP / 3 of the steps, the whole unroll the rest; a
        # depth-1 pilot and linear interpolation price the ramp, so the budget buys its extra steps
        s_one = pilot_s_step(f"{kind}-depth1", preset, [h for h in fixed if not h.startswith("head.ttt_steps")] + ["head.ttt_steps=1"], args)
        s_step = RAMP / 3 * (s_one + (s_one + s_step) / 2 + s_step) + (1 - RAMP) * s_step
    return study_steps(kind, preset, head, max(4, int(args.minutes * 60 / s_step)), s_step, args)


def study_steps(kind: str, preset: str, head: list[str], steps: int, s_step: float | None, args) -> dict:
    """Train `kind` for `steps` optimizer steps, then bench it (module docstring); s_step: the
    pilot's seconds per step, else measured from this run."""
    work = Path(args.work)
    out = work / kind
    every = max(1, steps // 4)
    train_s = run(
        [
            BIN / "drafthead",
            "train",
            "--config",
            preset,
            *train_overrides(work, out, args.threads),
            *head,
            f"max_steps={steps}",
            f"warmup_steps={max(1, steps // 10)}",
            f"eval_every={every}",
            f"checkpoint_every={steps}",
            "log_every=5",
            "eval_batches=12",
        ],
        work / f"{kind}-train.log",
    )
    rows = metrics(out)
    evals = [r for r in rows if r.get("split") == "eval"]
    if s_step is None:
        s_step = train_s / steps
    final = out / "final"
    write_chain(final, preset, args.chain)
    bench = work / f"{kind}-bench.json"
    run(bench_command(final, bench, args), work / f"{kind}-bench.log")
    report = json.loads(bench.read_text())
    last = evals[-1] if evals else {}
    accs = [last[f"acc_{i}"] for i in range(8) if f"acc_{i}" in last]
    return {
        "kind": kind,
        "steps": steps,
        "s_step": s_step,
        "train_minutes": train_s / 60,
        "eval_curve": [(e["step"] * s_step / 60, e.get("tau_est")) for e in evals],
        "eval_acc": accs,
        "eval_tau_est": last.get("tau_est"),
        "bench_tau": report["tau"],
        "bench_acceptance": report["per_position_acceptance"][: args.chain],
        "tokens_per_s": report["tokens_per_s"],
        "baseline_tokens_per_s": report["baseline_tokens_per_s"],
        "speedup": report["speedup"],
        "identical_fraction": report["identical_fraction"],
        "draft_share": report["profile"]["fractions"].get("draft"),
        **(confidence_bench(kind, final, args) if preset == "dspark" else {}),
    }


def write_chain(head: Path, kind: str, k: int) -> None:
    """A drafting.json drafting a chain of k top-1 drafts, in the terms of `kind`'s drafter."""
    import dataclasses

    from drafthead.inference.drafters.load import chain_settings

    tree = {k: v for k, v in dataclasses.asdict(chain_settings(kind, k)).items() if v is not None}
    (head / "drafting.json").write_text(json.dumps(tree) + "\n")


def bench_command(head: Path, out: Path, args, *extra) -> list:
    """`drafthead bench` of `head` on the study's prompts, fp32, no lookup nodes, report to `out`."""
    sizes = ["--threads", args.threads, "--limit", args.prompts, "--max-new-tokens", args.max_new_tokens]
    return [BIN / "drafthead", "bench", "--head", head, "--dtype", "float32", *sizes, "--lookup-nodes", 0, *extra, "--no-progress", "--out", out]


def confidence_bench(kind: str, final: Path, args) -> dict:
    """A DSpark head's bench with the confidence head sizing each round (`--sizing confidence`):
    tau, tokens/s and the mean number of drafts it verified, on torch and on the llama.cpp backend
    where `make llamacpp` built it."""
    from drafthead.ground.files import read_json

    block = read_json(final / "config.json")["config"]["block_size"]  # every slot a candidate: the whole block
    write_chain(final, "dspark", block)
    out = {}
    for backend in ("torch", "llama.cpp"):
        bench = Path(args.work) / f"{kind}-confidence-{backend}.json"
        try:
            run(
                bench_command(final, bench, args, "--sizing", "confidence", "--backend", backend),
                Path(args.work) / f"{kind}-confidence-{backend}.log",
            )
        except SystemExit as e:
            out[f"confidence_{backend}"] = {"error": str(e)[:300]}
            continue
        report = json.loads(bench.read_text())
        drafted = [d for p in report["prompts"] for d in p["drafted"]]
        out[f"confidence_{backend}"] = {
            "tau": report["tau"],
            "tokens_per_s": report["tokens_per_s"],
            "baseline_tokens_per_s": report["baseline_tokens_per_s"],
            "mean_verified_drafts": sum(drafted) / max(len(drafted), 1),
            "identical_fraction": report["identical_fraction"],
        }
    return out


def table(results: list[dict], args) -> str:
    budget = "steps" if args.steps else f"steps in {args.minutes:g} min"
    lines = [
        f"| head | {budget} | held-out acc per depth | held-out tau_est | bench tau (chain "
        f"{args.chain}) | acceptance per position | tokens/s (plain) | draft share |",
        "| --- | ---: | --- | ---: | ---: | --- | ---: | ---: |",
    ]
    for r in results:
        accs = ", ".join(f"{a:.2f}" for a in r["eval_acc"])
        acc_pos = ", ".join(f"{a:.2f}" for a in r["bench_acceptance"])
        share = "-" if r["draft_share"] is None else f"{r['draft_share']:.0%}"
        lines.append(
            f"| {r['kind']} | {r['steps']} ({r['s_step']:.1f} s/step) | {accs} | {r['eval_tau_est']:.2f} | "
            f"{r['bench_tau']:.2f} | {acc_pos} | {r['tokens_per_s']:.1f} ({r['baseline_tokens_per_s']:.1f}) | "
            f"{share} |"
        )
    return "\n".join(lines)


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for r in results:
        xs, ys = zip(*r["eval_curve"]) if r["eval_curve"] else ([], [])
        (line,) = ax.plot(xs, ys, marker="o", label=f"{r['kind']} (held-out tau_est)")
        ax.scatter([r["train_minutes"]], [r["bench_tau"]], marker="*", s=160, color=line.get_color())
    ax.set_xlabel("training minutes (2 CPU threads)")
    ax.set_ylabel("tau")
    ax.set_title("tau per CPU-minute: held-out estimate (lines), MT-bench chain tau (stars)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work", default="runs/study")
    p.add_argument("--kinds", default="eagle3,eagle31,peagle,dflash,medusa1")
    p.add_argument("--minutes", type=float, default=7.0, help="training budget per kind")
    p.add_argument("--steps", type=int, default=None, help="instead of --minutes: this many optimizer steps per kind")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--chain", type=int, default=3, help="drafts per round in the bench (a chain)")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    args = p.parse_args(argv)
    work = Path(args.work)
    if not (work / "features").is_dir():
        raise SystemExit(f"no captured features in {work}/features (module docstring)")
    done = work / "study.json"
    results = json.loads(done.read_text()) if done.is_file() else []
    for kind in args.kinds.split(","):
        if kind not in KINDS:
            raise SystemExit(f"unknown kind {kind!r} (known: {', '.join(KINDS)})")
        if any(r["kind"] == kind for r in results):
            continue  # resumable: a finished kind is kept
        print(f"[study] {kind}", flush=True)
        results.append(study_kind(kind, args))
        done.write_text(json.dumps(results, indent=1))
    (work / "study.md").write_text(table(results, args) + "\n")
    plot(results, work / "study.png")
    print(table(results, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
