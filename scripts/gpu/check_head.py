"""The head the GPU run brought back, checked here on the CPU (docs/testing.md "The GPU run"):
its parts checked and joined (scripts/gpu/parts.py), the head loaded onto the target, and its tau
as a chain of 3 replayed (inference/bench/replay.py) on the target's own fp32 greedy answers to
MT-bench prompts, beside the shipped head's on the same answers.

    .venv/bin/python scripts/gpu/check_head.py --parts <files_at>/head --out out/gpu-head

The new head replaces the shipped one if and only if its tau beats SHIPPED_TAU (the issue's bar:
the shipped head's chain-3 tau on 20 MT-bench prompts, fp32, 256 tokens); the script says which,
and writes the figures to --out/check.json. --budget dry: one prompt of 8 tokens (tests).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from parts import checked  # noqa: E402  (a sibling script)

SHIPPED_TAU = 1.55
BUDGETS = {"full": (20, 256), "dry": (1, 8)}  # MT-bench prompts, tokens a prompt


def chain_tau(model, tokenizer, head: Path, sequences: list, chain: int) -> dict:
    """The head's replayed chain over `sequences` ((sequence [1, T], prompt length) pairs)."""
    from types import SimpleNamespace

    from drafthead.draft_spec import DraftSpec
    from drafthead.inference.bench.replay import kept_hidden_states, replay_greedy
    from drafthead.inference.engine.rounds import per_position_acceptance, tau_of

    loaded = SimpleNamespace(name="smollm2-135m", model=model, tokenizer=tokenizer)
    drafter = DraftSpec(head=str(head), chain=chain, lookup_nodes=0).build(loaded, note=lambda line: None).factory()  # the head alone
    rounds = []
    for sequence, prompt_len in sequences:
        rounds += replay_greedy(drafter, sequence, prompt_len, kept_hidden_states(model, sequence, [drafter]))
    return {"tau": round(tau_of(rounds), 4), "acceptance": [round(a, 4) for a in per_position_acceptance(rounds, chain)], "rounds": len(rounds)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", required=True, help="the folder the GPU run's head parts came back in (its manifest.json and parts)")
    p.add_argument("--out", required=True)
    p.add_argument("--budget", choices=sorted(BUDGETS), default="full")
    p.add_argument("--chain", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    head = out / "head"
    status = checked(args.parts, str(head))
    if status != 0:
        return status

    import torch

    from drafthead import load_target
    from drafthead.heads import pretrained
    from drafthead.inference.bench.prompts import encode_chat, load_prompts
    from drafthead.inference.bench.replay import greedy_continuations
    from drafthead.ground.target.identity import eos_token_ids

    count, new_tokens = BUDGETS[args.budget]
    loaded = load_target("smollm2-135m", dtype="float32", threads=args.threads)
    model, tokenizer = loaded.model, loaded.tokenizer
    prompts = [encode_chat(tokenizer, prompt) for prompt in load_prompts("mt-bench", count)]
    answers = greedy_continuations(model, prompts, new_tokens, eos_token_ids(model, tokenizer))
    sequences = [(torch.cat([p, torch.tensor([a])], dim=1), p.shape[1]) for p, a in zip(prompts, answers) if a]
    result = {
        "prompts": len(sequences),
        "max_new_tokens": new_tokens,
        "dtype": "float32",
        "chain": args.chain,
        "new": chain_tau(model, tokenizer, head, sequences, args.chain),
        "shipped": chain_tau(model, tokenizer, Path(pretrained.__file__).parent / "smollm2-135m", sequences, args.chain),
        "bar": SHIPPED_TAU,
    }
    result["replaces_shipped"] = result["new"]["tau"] > SHIPPED_TAU
    (out / "check.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result), flush=True)
    verdict = "replaces the shipped head" if result["replaces_shipped"] else "does not replace the shipped head"
    new, shipped = result["new"]["tau"], result["shipped"]["tau"]
    print(f"new head chain-{args.chain} tau {new} (the shipped head's {shipped} on the same answers; the bar {SHIPPED_TAU}): {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
