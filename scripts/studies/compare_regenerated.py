"""Two `data regenerate` outputs of the same conversations compared token for token: our engine's
and a serving engine's (`--server`), both with their answers' token ids. Prints how many answers are
identical and, for each conversation that parts, where and by what logit gap of our target
(train/regeneration/compare.py): a near-tie explains a parting, a large gap does not.

    python scripts/studies/compare_regenerated.py --target smollm2-135m out/ours.jsonl out/server.jsonl \\
        --json out/parity.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from drafthead.ground.target.load import load_target
from drafthead.train.regeneration.compare import compare_regenerations


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("ours", type=Path)
    p.add_argument("theirs", type=Path)
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path, default=None, help="write the partings here")
    args = p.parse_args()
    loaded = load_target(args.target, dtype=args.dtype, threads=args.threads)
    read = lambda path: [json.loads(line) for line in path.read_text().splitlines() if line.strip()]  # noqa: E731
    comparison = compare_regenerations(loaded.model, loaded.tokenizer, read(args.ours), read(args.theirs))
    print(comparison.summary())
    for parting in comparison.partings:
        print(f"  {parting.id} turn {parting.turn}: token {parting.position}, ours {parting.ours} vs {parting.theirs}, logit gap {parting.gap:.4f}")
    if args.json:
        args.json.write_text(
            json.dumps(
                {"answers": comparison.answers, "identical": comparison.identical, "partings": [q.to_dict() for q in comparison.partings]}, indent=1
            )
        )


if __name__ == "__main__":
    main()
