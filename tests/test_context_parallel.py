"""Context parallelism for EAGLE-3 (heads/context_split.py): one row's columns split across 2 gloo
processes give the unsplit loss and gradients, the ranks' shares summed, within fp32 rounding: one
row or packed rows, GQA, a sliding window, rows whose length the ranks do not divide (the last
shard padded), one attention chunk or chunks of a few rows, and the losses that weigh a row's
positions together (LK^lambda, the entropy curriculum)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from drafthead.heads import ttt_attention as ttt
from drafthead.heads.context_split import ContextSplit
from drafthead.heads.registry import build_head, make_config
from drafthead.inference.servers.local import free_port
from drafthead.train.capture.features import collate
from drafthead.train.capture.packing import collate_packed
from tests.eagle3_rows import V, loss_and_grads, samples_of
from tests.tiny import tiny_causal_lm

pytestmark = pytest.mark.subprocess  # starts processes of its own (pyproject.toml markers)

EVEN, ODD = (23, 17, 30, 9), (23, 17, 31)  # rows of 30 / 31 columns; packed into 40: rows of 40 / 40 and 31
CASES = {  # name: (family, packed, sample lengths, attention chunk budget in bytes or None)
    "llama": ("llama", False, EVEN, None),
    "llama-packed-chunks": ("llama", True, EVEN, 3 * 4 * 4 * 40),
    "mistral-window-packed-odd": ("mistral", True, ODD, None),
    "qwen3-odd-chunks": ("qwen3", False, ODD, 2 * 4 * 4 * 40),
    # what weighs a row's positions together: over the whole row, not each rank's share
    "llama-lk_lambda": ("llama", False, ODD, None),
    "llama-packed-entropy_ramp": ("llama", True, EVEN, None),
}
HEAD = {"llama-lk_lambda": {"loss": "lk_lambda"}, "llama-packed-entropy_ramp": {"entropy_ramp": 0.5, "entropy_start": 0.3}}


def head_and_batch(family: str, packed: bool, lengths, case: str = ""):
    target = tiny_causal_lm(family, vocab=V, layers=4, hidden=32)
    torch.manual_seed(0)
    config = make_config("eagle3", target, None, name="tiny", ttt_steps=3, draft_layer="target", **HEAD.get(case, {}))
    head = build_head(config, target, token_counts=torch.arange(V), dtype=torch.float32).train()
    if "entropy_ramp" in case:
        head.train_progress = 0.2  # the curriculum keeps the 58% of positions of lowest entropy
    samples = samples_of(target, lengths)
    batch = collate_packed(samples, 40) if packed else collate(samples)
    return head, batch


def worker(rank: int, size: int, port: int, out: str) -> None:
    """Every case in one process group: starting the two ranks costs more than a case's step."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=size)
    try:
        for case, (family, packed, lengths, budget) in CASES.items():
            ttt.CHUNK_BYTES, before = (budget or ttt.CHUNK_BYTES), ttt.CHUNK_BYTES
            head, batch = head_and_batch(family, packed, lengths, case)
            head.context_split = ContextSplit(rank, size)
            loss, grads = loss_and_grads(head, batch)
            _, metrics = head.compute_loss(batch)
            ttt.CHUNK_BYTES = before
            dist.all_reduce(loss)
            for g in grads.values():
                dist.all_reduce(g)
            if rank == 0:
                torch.save({"loss": loss, "grads": grads, "metrics": metrics}, f"{out}/{case}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def split_runs(run_once):
    """case -> the split run's summed loss, gradients and metrics (one spawn of two ranks a test run)."""
    out = run_once("context-split", lambda folder: mp.start_processes(worker, args=(2, free_port(), str(folder)), nprocs=2, start_method="spawn"))
    return {case: torch.load(out / f"{case}.pt") for case in CASES}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_row_split_across_two_ranks_gives_the_unsplit_loss_and_gradients(case, split_runs):
    family, packed, lengths, budget = CASES[case]
    split = split_runs[case]
    if budget is not None:  # the same chunking unsplit
        ttt.CHUNK_BYTES, before = budget, ttt.CHUNK_BYTES
    try:
        head, batch = head_and_batch(family, packed, lengths, case)
        assert batch.input_ids.shape[1] % 2 == (lengths == ODD and not packed)  # odd: the last shard padded
        loss, grads = loss_and_grads(head, batch)
        _, metrics = head.compute_loss(batch)
    finally:
        if budget is not None:
            ttt.CHUNK_BYTES = before
    assert torch.allclose(split["loss"], loss, rtol=1e-5, atol=1e-6), (split["loss"], loss)
    assert grads.keys() == split["grads"].keys() and len(grads) > 5
    for name, g in grads.items():
        assert torch.allclose(split["grads"][name], g, rtol=1e-4, atol=1e-6), (name, (split["grads"][name] - g).abs().max())
    assert split["metrics"].keys() == metrics.keys()
    for key, value in metrics.items():
        assert split["metrics"][key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


def test_the_shards_cover_the_row():
    halves = [ContextSplit(r, 2).bounds(31) for r in range(2)]
    assert halves == [(0, 16), (16, 32)]
    assert [ContextSplit(r, 3).bounds(9) for r in range(3)] == [(0, 3), (3, 6), (6, 9)]


def test_a_split_that_does_not_divide_the_processes_is_refused_before_training(tmp_path, isolated_cache):
    from drafthead.train.loop.config import ConfigError, TrainConfig
    from drafthead.train.loop.run import build_trainer
    from drafthead.train.data.tiny import tiny_target, tiny_tokenizer, write_tiny_jsonl

    tok = tiny_tokenizer()
    cfg = TrainConfig.from_dict(
        dict(
            target="tiny",
            head={"kind": "eagle3", "draft_vocab_size": 64, "ttt_steps": 2},
            report_to="none",
            output_dir=str(tmp_path / "run"),
            context_parallel=2,
            batch_size=2,
            max_steps=1,
            checkpoint_every=0,
            data={"source": "json", "path": str(write_tiny_jsonl(tmp_path / "chats.jsonl", 8)), "max_length": 32, "eval_fraction": 0.0},
        )
    )
    trainer = build_trainer(cfg, tiny_target(tok), tok, target_name="tiny")
    with pytest.raises(ConfigError, match="context_parallel: 2 does not divide the 1 processes"):
        trainer.fit(progress=False)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
