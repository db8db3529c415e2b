"""Does a head trained on short rows hold deep into a long context? The shipped SmolLM2 EAGLE-3 head
(trained at 2K tokens) replayed on long ShareGPT prompts of several lengths.

    .venv/bin/python scripts/studies/tau_by_length.py --lengths 1024 2048 4096 8064 --count 6 \
        --out out/tau-by-length.json --plot out/tau-by-length.png

For each length, `--count` prompts of at most that many tokens (whole ShareGPT turns joined into
one multi-turn chat ending on a question: inference/bench/long_prompts.py, `drafthead data long-prompts`),
the target's greedy answer of `--max-new-tokens` (our engine, fp32), then the head's rounds
replayed on it (inference/bench/replay.py): a chain of 3 counted as our engine and as vLLM count,
and the head's default tree. SmolLM2-135M's context is 8,192 positions, so prompt + answer stay
within it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch


def plot(rows: list[dict], path: str, chain: int) -> None:
    """tau against the mean prompt length of each length's prompts, one line per way of drafting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4))
    x = [sum(r["prompt_tokens"]) / len(r["prompt_tokens"]) for r in rows]
    for key, label in (
        ("tree_tau", "its default tree (no lookup nodes)"),
        ("chain_tau", f"chain of {chain}"),
        ("chain_vllm_tau", f"chain of {chain}, counted as vLLM"),
    ):
        ax.plot(x, [r[key] for r in rows], marker="o", label=label)
    ax.set_xscale("log")
    ax.minorticks_off()
    ax.set_xticks(x, [f"{v / 1024:.1f}K" for v in x])
    ax.set(
        xlabel="prompt tokens (mean of each length's prompts)",
        ylabel="tau (tokens per round)",
        title="shipped SmolLM2 EAGLE-3 head (trained at 2K), long ShareGPT prompts",
        ylim=(1.0, None),
    )
    ax.title.set_fontsize(10)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8064])
    p.add_argument("--count", type=int, default=6, help="prompts per length")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--chain", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", required=True, help="JSON report")
    p.add_argument("--plot", default=None, help="PNG: tau against prompt length")
    p.add_argument("--replot", action="store_true", help="only draw --plot from the rows already in --out")
    args = p.parse_args(argv)
    if args.replot:
        plot(json.loads(Path(args.out).read_text())["rows"], args.plot, args.chain)
        return 0

    from tqdm.auto import tqdm

    from drafthead.draft_spec import DraftSpec
    from drafthead.inference.bench.prompts import Prompt, encode_chat
    from drafthead.inference.bench.replay import DRAFTHEAD, VLLM, greedy_continuations, kept_hidden_states, replay_greedy, tokens_past_end
    from drafthead.inference.engine.rounds import per_position_acceptance, tau_of
    from drafthead.ground.target.identity import eos_token_ids
    from drafthead.ground.target.load import load_target
    from drafthead.inference.bench.long_prompts import long_chats
    from drafthead.train.data.sources import sharegpt_chats

    loaded = load_target("smollm2-135m", dtype="float32", threads=args.threads)
    chain = DraftSpec(proposer="head", chain=args.chain, lookup_nodes=0, lookup_streak=0).build(loaded).factory()
    tree = DraftSpec(proposer="head", lookup_nodes=0, lookup_streak=0).build(loaded).factory()
    conversations = sharegpt_chats()
    rows = []
    for length in args.lengths:
        chats = long_chats(conversations, loaded.tokenizer, length, args.count)  # the stream goes on: no chat twice
        prompts = [encode_chat(loaded.tokenizer, Prompt(text=c["messages"][-1]["content"], messages=tuple(c["messages"]))) for c in chats]
        answers = greedy_continuations(loaded.model, prompts, args.max_new_tokens, eos_token_ids(loaded.model, loaded.tokenizer), batch_size=2)
        counted = {"chain": [], "chain_vllm": [], "tree": []}
        sequences = [torch.cat([p, torch.tensor([a])], dim=1) for p, a in zip(prompts, answers)]
        past = tokens_past_end(loaded.model, sequences, args.chain, batch_size=2)
        for prompt, answer, extra in tqdm(list(zip(prompts, sequences, past)), desc=f"{length} tokens", unit="prompt"):
            sequence = torch.cat([answer, torch.tensor([extra])], dim=1)
            hidden = kept_hidden_states(loaded.model, sequence, [chain, tree])
            n, end = prompt.shape[1], answer.shape[1]
            counted["chain"] += replay_greedy(chain, sequence, n, hidden, end, DRAFTHEAD)
            counted["chain_vllm"] += replay_greedy(chain, sequence, n, hidden, end, VLLM)
            counted["tree"] += replay_greedy(tree, sequence, n, hidden, end, DRAFTHEAD)
        row = {
            "length": length,
            "prompt_tokens": [p.shape[1] for p in prompts],
            "answer_tokens": [a.shape[1] - p.shape[1] for p, a in zip(prompts, sequences)],
            **{f"{k}_tau": tau_of(v) for k, v in counted.items()},
            "chain_acceptance": per_position_acceptance(counted["chain"], args.chain),
            "chain_rounds": len(counted["chain"]),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
        Path(args.out).write_text(json.dumps({"settings": vars(args), "rows": rows}, indent=1) + "\n")
    if args.plot:
        plot(rows, args.plot, args.chain)
    return 0


if __name__ == "__main__":
    sys.exit(main())
