"""What replayed acceptance (train/loop/replay_eval.py) costs a SmolLM2-135M run at each eval, and what it
reports for the shipped EAGLE-3 head, with the eagle3 preset's replay settings (fp32).

    .venv/bin/python scripts/studies/replay_eval_cost.py --limit 500 --threads 1

The first eval also decodes the held-out prompts and runs the target over them once; later evals
only replay. docs/training.md "Replayed acceptance" quotes its output.
"""

from __future__ import annotations

import argparse
import time


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--limit", type=int, default=500, help="conversations read; the eval split is 2%% of them")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)

    import torch

    from drafthead.proposers import default_head_path
    from drafthead.ground.target.identity import eos_token_ids
    from drafthead.heads.registry import load_head
    from drafthead.ground.target.load import load_target
    from drafthead.train.loop.config import load_config
    from drafthead.train.loop.replay_eval import ReplayEval
    from drafthead.train.loop.run import token_samples
    from drafthead.train.loop.trainer import split_indices

    cfg = load_config("eagle3", [f"data.limit={args.limit}"])
    loaded = load_target("smollm2-135m", dtype="float32", threads=args.threads)
    samples = token_samples(cfg, loaded.tokenizer).dataset
    _, eval_idx = split_indices(len(samples), cfg.data.eval_fraction, cfg.data.eval_size, cfg.seed)
    head, _ = load_head(default_head_path("smollm2-135m"), loaded.model, loaded.tokenizer, dtype=torch.float32)
    replay = ReplayEval(loaded.model, torch.utils.data.Subset(samples, eval_idx), cfg.replay, eos_token_ids(loaded.model, loaded.tokenizer))
    start = time.perf_counter()
    replay(head)
    first = time.perf_counter() - start
    start = time.perf_counter()
    metrics = replay(head)
    later = time.perf_counter() - start
    held_out = replay.held_out(())
    print(
        f"{len(held_out)} held-out prompts ({sum(h.prompt_len for h in held_out)} prompt tokens, "
        f"{sum(h.end - h.prompt_len for h in held_out)} continuation tokens), {args.threads} thread(s)"
    )
    print(f"first eval {first:.1f} s (decode + target features + replay), later evals {later:.1f} s (replay)")
    print(", ".join(f"{k}={v:.3g}" for k, v in metrics.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
