"""Tokens/s against batch size: plain batched generate(), our engine with no drafting, the shipped
head's fixed tree and the load policy (`--sizing policy`), in one run, batch by batch interleaved.

    .venv/bin/python scripts/studies/bench_batch.py --batch-sizes 1,2,4,8,16 --limit 16 --max-new-tokens 128 \
        --dtype bfloat16 --out out/batch

writes out/batch/batch.json, batch.md (the table) and batch.png (the plot docs/results.md shows).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", default="1,2,4,8,16")
    parser.add_argument("--limit", type=int, default=16, help="MT-bench prompts (the first N)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument(
        "--round-weights",
        default=None,
        choices=("bfloat16",),
        help="the target's weights rounded to bf16 values (ground/target/load.py round_to_bfloat16)",
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--identity", action="store_true", help="also compare every row with its batch-1 plain output")
    parser.add_argument("--methods", default="fixed tree,policy", help="which of: fixed tree, policy")
    parser.add_argument("--out", default="out/batch")
    args = parser.parse_args()

    from drafthead.draft_spec import DraftSpec
    from drafthead.inference.bench.batch import format_batch_table, run_batch_bench
    from drafthead.inference.bench.run import BenchSettings
    from drafthead.inference.engine.drafter import fork_drafter
    from drafthead.inference.engine.sizing import forget_sizing, load_policy
    from drafthead.inference.bench.prompts import load_prompts
    from drafthead.ground.target.identity import eos_token_ids
    from drafthead.ground.target.load import load_target

    loaded = load_target("smollm2-135m", dtype=args.dtype, threads=args.threads, round_weights=args.round_weights)
    shipped = DraftSpec(proposer="head").build(loaded)
    drafter, model = shipped.factory(), shipped.model
    policy_drafter = fork_drafter(drafter)  # its own state: the policy's rounds never touch the fixed tree's
    curve = load_policy(model, policy_drafter, False).verify_cost  # the engine's, as the policy rounds use it
    prompts = load_prompts("mt-bench", args.limit)
    settings = BenchSettings(
        max_new_tokens=args.max_new_tokens,
        eos_token_ids=eos_token_ids(model, loaded.tokenizer),
        info={
            "target": "smollm2-135m",
            "dtype": args.dtype,
            "round_weights": args.round_weights,
            "threads": args.threads,
            "verify_cost": {"tokens": curve.nodes, "seconds": curve.seconds},
        },
    )
    reports = []
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        forget_sizing(model)  # each batch size's policy starts cold (and times the forward again)
        methods = {"fixed tree": (lambda: drafter, "fixed"), "policy": (lambda: policy_drafter, "policy")}
        methods = {name: methods[name] for name in args.methods.split(",")}
        report = run_batch_bench(model, loaded.tokenizer, methods, prompts, settings, batch, check_identity=args.identity)
        print(format_batch_table(report), flush=True)
        reports.append(report)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "batch.json").write_text(json.dumps(reports, indent=2) + "\n")
    (out / "batch.md").write_text(markdown(reports, args))
    plot(reports, out / "batch.png", args)
    print(f"wrote {out}/batch.json, batch.md, batch.png")
    return 0


def markdown(reports: list[dict], args) -> str:
    names = list(reports[0]["methods"])
    lines = [
        f"SmolLM2-135M, {args.dtype}, {args.threads} threads, {reports[0]['num_prompts']} MT-bench prompts x "
        f"{args.max_new_tokens} tokens, greedy; tokens/s of all rows together, prefill included; "
        f"CPU: {reports[0]['settings'].get('cpu_model', '?')}.",
        "",
        "| batch | plain generate() | ours, no drafting | " + " | ".join(f"{n} (tau)" for n in names) + " | identical |",
        "| ---: | ---: | ---: | " + " | ".join("---:" for _ in names) + " | --- |",
    ]
    for r in reports:
        cells = []
        for name in names:
            m = r["methods"][name]
            extra = "" if not m["policy"] else (f", {m['policy']['mean_nodes']:.1f} nodes/row, {100 * m['policy']['plain_rounds']:.0f}% plain rounds")
            cells.append(f"{m['tokens_per_s']:.1f} ({m['tau']:.2f}{extra})")
        same = [r["methods"][n]["identical_fraction"] for n in names]
        same_text = "-" if None in same else f"{100 * min(same):.0f}%"
        lines.append(
            f"| {r['batch_size']} | {r['baseline_tokens_per_s']:.1f} | {r['engine_plain_tokens_per_s']:.1f} | "
            + " | ".join(cells)
            + f" | {same_text} |"
        )
    return "\n".join(lines) + "\n"


def plot(reports: list[dict], path: Path, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [r["batch_size"] for r in reports]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(sizes, [r["baseline_tokens_per_s"] for r in reports], "o-", label="plain generate()")
    ax.plot(sizes, [r["engine_plain_tokens_per_s"] for r in reports], "s--", label="ours, no drafting")
    for name, style in (("fixed tree", "^-"), ("policy", "D-")):
        if name not in reports[0]["methods"]:
            continue
        ax.plot(sizes, [r["methods"][name]["tokens_per_s"] for r in reports], style, label=f"ours, {name}")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(s) for s in sizes])
    ax.set_xlabel("batch size")
    ax.set_ylabel("tokens/s (all rows)")
    ax.set_title(f"SmolLM2-135M {args.dtype}, {args.threads} CPU threads, {args.max_new_tokens} tokens")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    raise SystemExit(main())
