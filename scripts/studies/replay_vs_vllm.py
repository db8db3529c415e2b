"""Replayed acceptance against vLLM's own, step by step, on the answers vLLM served.

    .venv-interop/vllm/bin/python scripts/interop/check_vllm.py --target ~/.cache/drafthead/targets/smollm2-135m \
        --head /tmp/rv/shipped-vllm --method eagle3 --num-spec-tokens 3 --prompts 80 --max-tokens 256 \
        --dtype float32 --kv-cache-gib 3 --skip-plain --out /tmp/rv/vllm80
    .venv/bin/python scripts/studies/replay_vs_vllm.py --vllm /tmp/rv/vllm80.json --out /tmp/rv/replay-vs-vllm.json

check_vllm.py records, per request, the drafts vLLM accepted at each verify step (its "detailed"
per-request spec-decode metrics). This script replays the same head (our folder, `--head`; the
vLLM folder is its export) as a chain of the same length on each served answer
(inference/bench/replay.py) and counts it two ways:

  drafthead   our engine's rounds: the first round drafts the answer's first token, the last one
              counts only tokens the answer keeps
  vllm        vLLM's steps: its prefill emits the first token, and the last step counts every draft
              the target accepts, past the end too (the target's next greedy tokens, decoded here)

It prints and writes per-position acceptance and tau for each, vLLM's measured figures, and how
many requests and steps the vllm counting reproduces exactly.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--vllm", required=True, help="check_vllm.py's PREFIX.json (with spec_accepted_per_step)")
    p.add_argument("--head", default=None, help="our head folder (default: the shipped smollm2-135m head)")
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", required=True, help="JSON report")
    args = p.parse_args(argv)

    from tqdm.auto import tqdm

    from drafthead.draft_spec import DraftSpec
    from drafthead.inference.bench.replay import DRAFTHEAD, VLLM, kept_hidden_states, replay_greedy, tokens_past_end
    from drafthead.inference.engine.rounds import per_position_acceptance, tau_of
    from drafthead.ground.target.load import load_target

    served = json.loads(Path(args.vllm).read_text())
    steps = served.get("spec_accepted_per_step")
    if not steps or any(s is None for s in steps):
        raise SystemExit(f"{args.vllm}: no per-request steps (rerun check_vllm.py, which records them)")
    chain = served["num_spec_tokens"]
    loaded = load_target(args.target, dtype=served["dtype"], threads=args.threads)
    drafter = DraftSpec(proposer="head", head=args.head, chain=chain, lookup_nodes=0, lookup_streak=0).build(loaded).factory()
    answers = [(torch.tensor([p + a]), len(p)) for p, a in zip(served["prompt_token_ids"], served["spec_token_ids"])]
    past = tokens_past_end(loaded.model, [s for s, _ in answers], chain)
    counted = {DRAFTHEAD.name: [], VLLM.name: []}
    equal_requests, equal_steps, all_steps, partings = 0, 0, 0, []
    for i, ((answer, prompt_len), extra) in enumerate(tqdm(list(zip(answers, past)), desc="replay", unit="answer")):
        sequence = torch.cat([answer, torch.tensor([extra])], dim=1)
        hidden = kept_hidden_states(loaded.model, sequence, [drafter])
        end = answer.shape[1]
        counted[DRAFTHEAD.name] += replay_greedy(drafter, sequence, prompt_len, hidden, end, DRAFTHEAD)
        ours = [n - 1 for n in replay_greedy(drafter, sequence, prompt_len, hidden, end, VLLM)]
        counted[VLLM.name] += [n + 1 for n in ours]
        theirs = steps[i]
        equal_requests += ours == theirs
        all_steps += len(theirs)
        equal_steps += sum(a == b for a, b in zip(ours, theirs))
        if ours != theirs:
            at = next((k for k, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
            partings.append(
                {
                    "request": i,
                    "step": at,
                    "replayed": ours[at : at + 4],
                    "vllm": theirs[at : at + 4],
                    "replayed_steps": len(ours),
                    "vllm_steps": len(theirs),
                }
            )
    metrics = served["metrics"]
    vllm_measured = {
        "tau": 1 + metrics["num_accepted_tokens"] / metrics["num_drafts"],
        "acceptance": [x / metrics["num_drafts"] for x in metrics["num_accepted_tokens_per_pos"]],
        "steps": metrics["num_drafts"],
    }
    report = {
        "vllm_file": args.vllm,
        "dtype": served["dtype"],
        "chain": chain,
        "prompts": len(answers),
        "max_tokens": served["max_tokens"],
        "vllm_measured": vllm_measured,
        "replayed": {name: {"tau": tau_of(a), "acceptance": per_position_acceptance(a, chain), "steps": len(a)} for name, a in counted.items()},
        "requests_equal_step_for_step": equal_requests,
        "steps_equal": equal_steps,
        "steps": all_steps,
        "partings": partings,
    }
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    fmt = lambda r: f"tau {r['tau']:.4f}  acceptance {', '.join(f'{x:.4f}' for x in r['acceptance'])}  steps {r['steps']}"  # noqa: E731
    print(f"vLLM measured          {fmt(vllm_measured)}")
    for name, r in report["replayed"].items():
        print(f"replayed, {name:<12} {fmt(r)}")
    print(f"step for step: {equal_requests}/{len(answers)} requests, {equal_steps}/{all_steps} steps")
    return 0


if __name__ == "__main__":
    sys.exit(main())
