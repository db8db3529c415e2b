"""A head trained for three steps through `drafthead train`'s own builder, on a tiny target folder
and tiny chats: how the family tables' training cells run (tests/test_families.py,
tests/test_hybrid.py)."""

from __future__ import annotations

import json
from pathlib import Path


def train_three_steps(folder: Path, loaded, head: dict, chats: Path, out: Path, target_name: str, max_length: int = 48, **settings):
    """(the trainer's result, its logged train losses) of a `head` (the config's head section) run
    on `loaded` (the folder's LoadedTarget) with online features; `settings`: more config keys."""
    from drafthead.train.loop.config import TrainConfig
    from drafthead.train.loop.run import build_trainer

    config = TrainConfig.from_dict(
        dict(
            target=str(folder),
            head=head,
            report_to="none",
            output_dir=str(out),
            data={"source": "json", "path": str(chats), "max_length": max_length, "eval_fraction": 0.0},
            batch_size=4,
            max_steps=3,
            log_every=1,
            lr=1e-2,
            warmup_steps=1,
            checkpoint_every=100,
            eval_every=100,
            **settings,
        )
    )
    result = build_trainer(config, loaded.model, loaded.tokenizer, target_name=target_name).fit(progress=False)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return result, [r["loss"] for r in rows if r.get("split") == "train"]
