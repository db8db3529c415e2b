"""Mix the target's regenerated answers with original ShareGPT first turns (not regenerated).

EAGLE-3 learns the target's own distribution at every position (soft targets from the target's
LM head), so original answers still teach it; they add diversity at no generation cost.

    python scripts/recipes/mix_data.py REGEN.jsonl OUT.jsonl --extra 1300 --skip 1500
    python scripts/recipes/mix_data.py REGEN.jsonl OUT2.jsonl --extra 1300 --skip 1500 --answers REGEN_EXTRA.jsonl

`--answers` swaps in the target's own answers to the mixed-in prompts (`data regenerate` run on
the first mix's extras, ids kept). Order and count stay those of the first mix, so a run with the
same seed holds out the same prompts: a continuation's eval stays clean.
"""

from __future__ import annotations

import argparse
import json

from drafthead.train.data.sources import read_conversations, sharegpt_path


def first_turn(messages: list[dict]) -> list[dict] | None:
    turns = [m for m in messages if m["role"] != "system"]
    if len(turns) >= 2 and turns[0]["role"] == "user" and turns[1]["role"] == "assistant":
        return turns[:2]
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("regen")
    ap.add_argument("out")
    ap.add_argument("--extra", type=int, default=1300, help="original ShareGPT conversations to add")
    ap.add_argument("--skip", type=int, default=1500, help="skip the first N (the regenerated ones)")
    ap.add_argument("--max-prompt-chars", type=int, default=1500)
    ap.add_argument("--answer-chars", type=int, nargs=2, default=(200, 2500))
    ap.add_argument("--answers", help="JSONL of regenerated conversations replacing records with the same id")
    args = ap.parse_args()
    regen = [json.loads(line) for line in open(args.regen)]
    conversations, _ = read_conversations(sharegpt_path(), limit=args.skip + 4 * args.extra)
    lo, hi = args.answer_chars
    extra = []
    for i, conv in enumerate(conversations[args.skip :]):
        turns = first_turn(conv["messages"])
        if turns and len(turns[0]["content"]) < args.max_prompt_chars and lo < len(turns[1]["content"]) < hi:
            extra.append({"id": f"sharegpt-{conv.get('id') or i}", "messages": turns})
        if len(extra) >= args.extra:
            break
    answers = {}
    if args.answers:
        answers = {r["id"]: r["messages"] for r in map(json.loads, open(args.answers))}
    replaced = sum(r["id"] in answers for r in extra)
    with open(args.out, "w") as f:
        for record in regen:
            f.write(json.dumps({"id": record["id"], "messages": record["messages"]}) + "\n")
        for record in extra:
            messages = answers.get(record["id"], record["messages"])
            f.write(json.dumps({"id": record["id"], "messages": messages}) + "\n")
    answered = f" ({replaced} re-answered by the target, {len(extra) - replaced} original)" if args.answers else ""
    print(f"{args.out}: {len(regen)} regenerated + {len(extra)} ShareGPT first turns{answered}")


if __name__ == "__main__":
    main()
