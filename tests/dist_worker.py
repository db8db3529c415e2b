"""The 2-process side of tests/test_distributed.py, run under `accelerate launch --num_processes 2`.

    python -m accelerate.commands.launch ... tests/dist_worker.py OUT TARGET CHATS

One launch trains, in turn:
  OUT/ddp, OUT/fsdp   the equal-length run (`equal_length_trainer`) under DDP, then under FSDP;
  OUT/cp, OUT/fsdp-cp the same run with each batch's rows split between the 2 ranks
                      (context_parallel: 2, batch 4: the one process's batches), under DDP, then FSDP;
  OUT/cli-fsdp        the CLI's tiny EAGLE-3 config under FSDP, to the end (the reference a killed
                      and resumed FSDP run must match bit for bit);
  OUT/stream-ddp      the same config reading its data as a stream (data.streaming), past an epoch end.
Every trainer builds its own fresh head from the same seed.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
TINY_CONFIG = REPO / "configs" / "tiny-eagle3.yaml"
EQUAL_LENGTH = 12  # tokens per synthetic sample
EQUAL_SAMPLES = 16


def tiny_config(target: str, chats: str, output_dir: str | Path, **overrides):
    from drafthead.train.loop.config import load_config

    base = {"target": target, "data.path": chats, "output_dir": str(output_dir), "threads": 1, "report_to": "none"}
    base.update(overrides)
    return load_config(str(TINY_CONFIG), [f"{k}={v}" for k, v in base.items()])


def equal_length_trainer(config, target_model, tokenizer):
    """A Trainer on synthetic samples of one length, every token labelled, no eval set.

    Equal lengths and full loss masks give every micro-batch the same label count per depth, so
    the mean of the ranks' mean losses is the global batch's mean loss: 2 ranks x batch B must
    then end with one process x batch 2B's weights (docs/scaling.md "Equivalence")."""
    from drafthead.train.loop.run import build_trainer

    trainer = build_trainer(config, target_model, tokenizer)
    g = torch.Generator().manual_seed(5)
    vocab = target_model.config.vocab_size
    trainer.data.train = [
        {"input_ids": torch.randint(3, vocab, (EQUAL_LENGTH,), generator=g), "loss_mask": torch.ones(EQUAL_LENGTH, dtype=torch.bool)}
        for _ in range(EQUAL_SAMPLES)
    ]
    trainer.data.eval = None
    return trainer


def main(out: str, target: str, chats: str) -> None:
    from drafthead.ground.target.load import load_target
    from drafthead.train.loop.run import run_training

    out = Path(out)
    for parallelism in ("ddp", "fsdp"):  # ddp first: fsdp shards the target's layers for good
        cfg = tiny_config(
            target, chats, out / parallelism, parallelism=parallelism, batch_size=2, max_steps=3, checkpoint_every=0, eval_every=0, warmup_steps=0
        )
        loaded = load_target(cfg.target, dtype=cfg.target_dtype, threads=1)
        equal_length_trainer(cfg, loaded.model, loaded.tokenizer).fit(progress=False)
    for name, parallelism in (("cp", "ddp"), ("fsdp-cp", "fsdp")):
        cfg = tiny_config(
            target,
            chats,
            out / name,
            context_parallel=2,
            parallelism=parallelism,
            batch_size=4,
            max_steps=3,
            checkpoint_every=0,
            eval_every=0,
            warmup_steps=0,
        )
        loaded = load_target(cfg.target, dtype=cfg.target_dtype, threads=1)
        equal_length_trainer(cfg, loaded.model, loaded.tokenizer).fit(progress=False)
    run_training(
        tiny_config(target, chats, out / "cli-fsdp", parallelism="fsdp", max_steps=8, checkpoint_every=1, eval_every=4), say=lambda message: None
    )
    stream = {"data.streaming": "true", "data.shuffle_buffer": 8}  # 48 chats - 8 eval: 5 batches of 2 x 4 per epoch
    run_training(tiny_config(target, chats, out / "stream-ddp", max_steps=7, checkpoint_every=0, eval_every=7, **stream), say=lambda message: None)
    from drafthead.train.capture.workshare import end_process_group

    end_process_group()  # as the CLI does: a group left to interpreter shutdown can abort a finished rank


if __name__ == "__main__":
    main(*sys.argv[1:])
