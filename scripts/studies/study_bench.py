"""The same-budget study's heads on all 80 MT-bench first turns x 256 tokens: chain tau, replayed.

    .venv/bin/python scripts/studies/study_bench.py --work runs/study --kinds eagle3,eagle31,peagle,dflash,medusa1 --shipped

scripts/studies/study_same_budget.py trains each kind and benches it at batch 1 on a few prompts. A bench
of every prompt at 256 tokens would cost about 30 minutes a kind here, nearly all of it target
forwards, which are the same for every head: greedy speculative output is the target's greedy
output. So this script decodes each prompt plainly once (our engine, batched, float32: the
output a batch-1 run gives, docs/cli.md "Batches"), runs the target once over each prompt +
continuation for its features, and replays every head's rounds on it (inference/bench/replay.py): the
accepted lengths the engine's rounds would give, without their target forwards.

`--shipped` adds the shipped EAGLE-3 head drafting the same chain (no tree, no lookup nodes):
the 2.2-hour reference the 7-minute heads stand against.

Writes WORK/greedy-<N>x<T>.json (the continuations, reused by later runs), WORK/bench-80.json,
WORK/bench-80.md (the table: tau, acceptance per chain position, drafting ms per round) and, with
the study's WORK/study.json, WORK/bench-80.png (tau against training minutes per kind).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

SHIPPED = "shipped EAGLE-3 (2.2 h)"


def cached_continuations(loaded, prompts, max_new_tokens: int, batch_size: int, path: Path) -> list[list[int]]:
    """Each prompt's greedy continuation by our engine with no drafting (inference/bench/replay.py
    greedy_continuations); cached in `path`, which records the settings it was made with."""
    from drafthead.inference.bench.replay import greedy_continuations
    from drafthead.ground.target.identity import eos_token_ids

    key = {"prompts": len(prompts), "max_new_tokens": max_new_tokens, "dtype": str(loaded.model.dtype)}
    if path.is_file():
        cached = json.loads(path.read_text())
        if cached["settings"] == key:
            return cached["continuations"]
    out = greedy_continuations(
        loaded.model,
        prompts,
        max_new_tokens,
        eos_token_ids(loaded.model, loaded.tokenizer),
        batch_size,
        on_batch=lambda done: print(f"[greedy] {done}/{len(prompts)} prompts", flush=True),
    )
    path.write_text(json.dumps({"settings": key, "continuations": out}) + "\n")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work", default="runs/study")
    p.add_argument("--kinds", default="eagle3,eagle31,peagle,dflash,medusa1")
    p.add_argument("--shipped", action="store_true", help="also the shipped head, drafting the same chain")
    p.add_argument("--chain", type=int, default=3, help="the chain length the study's drafting.json files hold")
    p.add_argument("--prompts", type=int, default=80)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=16, help="prompts per plain decoding batch")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)

    from tqdm.auto import tqdm

    from drafthead.draft_spec import DraftSpec
    from drafthead.inference.engine.rounds import per_position_acceptance, tau_of
    from drafthead.inference.bench.prompts import encode_chat, load_prompts
    from drafthead.inference.bench.replay import kept_hidden_states, replay_greedy
    from drafthead.ground.target.load import load_target

    work = Path(args.work)
    heads = {kind: work / kind / "final" for kind in args.kinds.split(",") if kind}
    for kind, path in heads.items():
        if not (path / "drafting.json").is_file():
            raise SystemExit(f"{path}: no trained head with its chain drafting.json (run scripts/studies/study_same_budget.py)")
    loaded = load_target("smollm2-135m", dtype="float32", threads=args.threads)
    drafters = {}
    if args.shipped:
        shipped = DraftSpec(proposer="head", chain=args.chain, lookup_nodes=0, lookup_streak=0)
        drafters[SHIPPED] = shipped.build(loaded).factory()
    for kind, path in heads.items():
        drafting = DraftSpec(head=str(path)).build(loaded)
        if drafting.model is not loaded.model:  # Medusa-2 adapts the target: its greedy output is another model's
            raise SystemExit(f"{kind}: its head changes the target (LoRA); replay it against its own target")
        drafters[kind] = drafting.factory()
    prompts = [encode_chat(loaded.tokenizer, prompt) for prompt in load_prompts("mt-bench", args.prompts)]
    continuations = cached_continuations(
        loaded, prompts, args.max_new_tokens, args.batch_size, work / f"greedy-{args.prompts}x{args.max_new_tokens}.json"
    )
    sequences = [torch.cat([p, torch.tensor([c])], dim=1) for p, c in zip(prompts, continuations) if c]
    starts = [p.shape[1] for p, c in zip(prompts, continuations) if c]
    features = [kept_hidden_states(loaded.model, s, drafters.values()) for s in tqdm(sequences, desc="features")]
    rows = []
    for name, drafter in drafters.items():  # one head at a time, the table rewritten after each
        accepted = []
        start = time.perf_counter()
        for sequence, prompt_len, hidden in tqdm(list(zip(sequences, starts, features)), desc=name, unit="prompt"):
            accepted += replay_greedy(drafter, sequence, prompt_len, hidden)
        rows.append(
            {
                "head": name,
                "tau": tau_of(accepted),
                "rounds": len(accepted),
                "tokens": sum(accepted),
                "acceptance": per_position_acceptance(accepted, args.chain),
                "draft_ms_per_round": 1000 * (time.perf_counter() - start) / len(accepted),
            }
        )
        (work / "bench-80.json").write_text(json.dumps({"settings": vars(args), "rows": rows}, indent=1) + "\n")
        table = markdown(rows, args)
        (work / "bench-80.md").write_text(table + "\n")
        print(table, flush=True)
    if (work / "study.json").is_file():
        plot(json.loads((work / "study.json").read_text()), rows, work / "bench-80.png", args)
    return 0


def plot(study: list[dict], rows: list[dict], path: Path, args) -> None:
    """Held-out tau_est against training minutes per kind (study.json), each kind's replayed tau
    over all prompts as a star at the end of its run, and the shipped head's as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tau = {r["head"]: r["tau"] for r in rows}
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for r in study:
        if r["kind"] not in tau:
            continue
        xs, ys = zip(*r["eval_curve"]) if r["eval_curve"] else ([], [])
        (line,) = ax.plot(xs, ys, marker="o", label=f"{r['kind']}: held-out tau_est; star: {tau[r['kind']]:.2f}")
        ax.scatter([r["train_minutes"]], [tau[r["kind"]]], marker="*", s=160, color=line.get_color())
    if SHIPPED in tau:
        ax.axhline(tau[SHIPPED], linestyle="--", color="gray", label=f"{SHIPPED}: {tau[SHIPPED]:.2f}")
    ax.set_xlabel("training minutes (2 CPU threads)")
    ax.set_ylabel("tau")
    ax.set_title(f"tau per CPU-minute; stars: {args.prompts} MT-bench prompts x {args.max_new_tokens}, chain of {args.chain} (replayed)", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def markdown(rows: list[dict], args) -> str:
    lines = [
        f"{args.prompts} MT-bench first turns x {args.max_new_tokens} tokens, float32, a chain of {args.chain} "
        f"drafts, greedy rounds replayed on the target's own continuations ({rows[0]['tokens']} tokens).",
        "",
        "| head | tau | acceptance per position | rounds | drafting ms per round |",
        "| --- | ---: | --- | ---: | ---: |",
    ]
    for r in rows:
        acc = ", ".join(f"{a:.2f}" for a in r["acceptance"])
        lines.append(f"| {r['head']} | {r['tau']:.2f} | {acc} | {r['rounds']} | {r['draft_ms_per_round']:.1f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
