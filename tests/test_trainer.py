"""The trainer on a dummy head and random FeatureBatches (no target, no real head: docs/style.md 9)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from drafthead.train.loop.checkpoint import latest_checkpoint
from drafthead.train.loop.config import ConfigError, TrainConfig
from drafthead.train.loop.evaluate import estimate_tau
from drafthead.train.loop.trainer import (
    NonFiniteLossError,
    Trainer,
    TrainData,
    batches_per_epoch,
    epoch_batches,
    lr_factor,
    split_indices,
)
from tests.trainer_checks import DummyHead, config, random_samples


def test_lr_schedule_rules():
    # warmup ramps linearly, cosine ends at min_ratio, linear is halfway at the middle
    assert lr_factor(0, 4, 100, "cosine") == pytest.approx(0.25)
    assert lr_factor(3, 4, 100, "cosine") == pytest.approx(1.0)
    assert lr_factor(4, 4, 104, "cosine") == pytest.approx(1.0)
    assert lr_factor(104, 4, 104, "cosine", 0.1) == pytest.approx(0.1)
    assert lr_factor(54, 4, 104, "linear") == pytest.approx(0.5)
    assert lr_factor(54, 4, 104, "constant") == 1.0
    # slow twin of cosine
    for s in range(4, 104):
        p = (s - 4) / 100
        assert lr_factor(s, 4, 104, "cosine") == pytest.approx(0.5 * (1 + math.cos(math.pi * p)))


def test_epoch_batches_partition_the_shuffle_across_processes():
    n, bs, world = 23, 3, 2
    per_rank = [epoch_batches(n, bs, world, r, seed=5, epoch=1) for r in range(world)]
    assert all(len(b) == batches_per_epoch(n, bs, world) == 3 for b in per_rank)
    flat = [i for batches in per_rank for b in batches for i in b]
    assert len(flat) == len(set(flat)) == 18  # disjoint, remainder dropped
    assert epoch_batches(n, bs, world, 0, 5, 1) == per_rank[0]  # deterministic
    assert epoch_batches(n, bs, world, 0, 5, 2) != per_rank[0]  # reshuffled each epoch


def test_split_indices():
    train, held = split_indices(100, 0.1, 5, seed=0)
    assert len(held) == 5 and len(train) == 95 and not set(train) & set(held)
    assert split_indices(100, 0.1, 5, seed=0) == (train, held)
    assert split_indices(10, 0.0, None, seed=0) == (list(range(10)), [])


def test_estimate_tau():
    assert estimate_tau([]) == 1.0
    assert estimate_tau([1.0, 1.0, 1.0]) == 4.0
    assert estimate_tau([0.5, 0.5]) == pytest.approx(1 + 0.5 + 0.25)


def test_loss_falls_and_outputs_are_written(tmp_path):
    torch.manual_seed(0)
    samples = random_samples(48)
    data = TrainData(train=samples[:40], eval=samples[40:])
    cfg = config(tmp_path, max_steps=40, checkpoint_every=20, eval_every=20, keep_checkpoints=1)
    result = Trainer(cfg, DummyHead(), data).fit(progress=False)
    out = tmp_path / "run"
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in lines if r.get("split") == "train"]
    evals = [r for r in lines if r.get("split") == "eval"]
    assert train[-1]["loss"] < 0.5 * train[0]["loss"], (train[0]["loss"], train[-1]["loss"])
    assert evals[-1]["acc_0"] > evals[0]["acc_0"] - 1e-9 and evals[-1]["acc_0"] > 0.5
    assert evals[-1]["tau_est"] == pytest.approx(estimate_tau([evals[-1]["acc_0"], evals[-1]["acc_1"]]))
    assert "tokens_per_s" in train[-1] and train[-1]["tokens_per_s"] > 0
    assert lines[0]["event"] == "start" and lines[0]["world_size"] == 1
    assert result.state.step == 40 and (out / "final" / "head.pt").exists()
    # keep_checkpoints=1: only the last one stays, and `latest` points at it
    assert [p.name for p in (out / "checkpoints").glob("step-*")] == ["step-00000040"]
    assert latest_checkpoint(out).name == "step-00000040"


def test_grad_accumulation_matches_a_bigger_batch(tmp_path):
    """2 micro-batches of 2 with accumulation == 1 batch of 4. Equal lengths and masks make the
    token-mean loss of the batch equal the mean of the two halves' losses, so gradients agree."""
    samples = random_samples(4, length=12)

    def run(bs, accum, sub):
        torch.manual_seed(1)
        head = DummyHead()
        head.drop.p = 0.0
        cfg = config(tmp_path / sub, batch_size=bs, grad_accum=accum, max_steps=1, eval_every=0, checkpoint_every=0, lr=0.1, clip_norm=None)
        # one sample order for both: the step sees samples 0..3 (epoch permutation is fixed by seed)
        t = Trainer(cfg, head, TrainData(train=samples[:4]))
        t.fit(progress=False)
        return [p.detach().clone() for p in head.parameters()]

    torch.manual_seed(1)
    init = [p.detach().clone() for p in DummyHead().parameters()]
    a, b = run(4, 1, "a"), run(2, 2, "b")
    assert any(not torch.equal(x, y) for x, y in zip(a, init))  # the step moved the weights
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=0)


def test_nan_loss_stops_with_step_named_and_checkpoint_kept(tmp_path):
    samples = random_samples(24)
    cfg = config(tmp_path, max_steps=20, checkpoint_every=4, eval_every=0)
    head = DummyHead(nan_at_call=7)  # step 7 (one micro-batch per step, no eval calls)
    with pytest.raises(NonFiniteLossError, match=r"at step 7\b.*step-00000004"):
        Trainer(cfg, head, TrainData(train=samples)).fit(progress=False)
    out = tmp_path / "run"
    assert latest_checkpoint(out).name == "step-00000004"
    assert not (out / "final").exists()


def test_refuses_to_overwrite_checkpoints_without_resume(tmp_path):
    samples = random_samples(16)
    cfg = config(tmp_path, max_steps=2, checkpoint_every=1, eval_every=0)
    Trainer(cfg, DummyHead(), TrainData(train=samples)).fit(progress=False)
    with pytest.raises(ValueError, match="--resume"):
        Trainer(cfg, DummyHead(), TrainData(train=samples)).fit(progress=False)


# ---------------------------------------------------------------------------------------------- real heads


@pytest.mark.parametrize(
    "kind,extra",
    [
        ("medusa1", {"num_heads": 2}),
        ("medusa2", {"num_heads": 2}),
        ("hydra", {"num_heads": 2}),
        ("eagle1", {}),
        ("eagle3", {"draft_vocab_size": 64, "ttt_steps": 2}),
        ("eagle31", {"draft_vocab_size": 64, "ttt_steps": 2}),
        ("peagle", {"draft_vocab_size": 64, "parallel_depth": 3, "mask_token_id": 0}),
        ("dflash", {"block_size": 4, "mask_token_id": 3, "num_anchors": 8}),
        ("dflash", {"block_size": 4, "mask_token_id": 3, "num_anchors": 8, "loss": "dpace"}),
        ("dspark", {"block_size": 4, "mask_token_id": 3, "num_anchors": 8, "markov_rank": 16}),
    ],
)
def test_real_heads_train_on_a_tiny_target(tmp_path, kind, extra, isolated_cache):
    """build_trainer end to end (chat data -> online features -> head) for every head kind: the
    loss falls, the final head reloads through heads.registry with the trained weights."""
    from drafthead.heads.registry import load_head
    from drafthead.train.loop.run import build_trainer
    from drafthead.train.data.tiny import tiny_target, tiny_tokenizer, write_tiny_jsonl

    tok = tiny_tokenizer()
    chats = write_tiny_jsonl(tmp_path / "chats.jsonl", 60)
    cfg = TrainConfig.from_dict(
        dict(
            target="tiny",
            head={"kind": kind, **extra},
            report_to="none",
            output_dir=str(tmp_path / "run"),
            data={"source": "json", "path": str(chats), "max_length": 64, "eval_fraction": 0.1, "eval_size": 8},
            batch_size=4,
            max_steps=16,
            eval_every=8,
            checkpoint_every=8,
            log_every=4,
            lr=1e-2,
            warmup_steps=1,
        )
    )
    trainer = build_trainer(cfg, tiny_target(tok), tok, target_name="tiny")
    result = trainer.fit(progress=False)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    # D-PACE's weights grow as the draft improves, so its weighted sum need not fall: the first
    # position's CE must
    key = "loss_0" if extra.get("loss") == "dpace" else "loss"
    losses = [r[key] for r in rows if r.get("split") == "train"]
    assert len(losses) == 4 and losses[-1] < losses[0] and all(math.isfinite(x) for x in losses)
    assert "acc_0" in result.eval_metrics and result.eval_metrics["tau_est"] >= 1.0

    head, _ = load_head(result.final_dir, tiny_target(tok), tok)
    for (name, a), (_, b) in zip(trainer.head.state_dict().items(), head.state_dict().items()):
        assert torch.equal(a.cpu(), b.cpu()), name
    if kind == "medusa2":
        assert (result.final_dir / "adapter").is_dir()
        lora = {k: v for k, v in trainer.module.trainable_state().items() if k.startswith("target.")}
        assert lora and any("lora_B" in k and v.abs().sum() > 0 for k, v in lora.items())  # B starts at zero
    if kind == "eagle3":
        # draft vocab = the 64 most frequent assistant tokens of the training split (+ EOS)
        from drafthead.heads.draft_vocab import build_draft_vocab

        train_idx = trainer.data.train.indices
        counts = trainer.data.train.dataset.token_counts(len(tok), train_idx)
        d2t, t2d = build_draft_vocab(counts, 64, [tok.eos_token_id])
        assert torch.equal(head.d2t.cpu(), d2t) and torch.equal(head.t2d.cpu(), t2d) and head.d2t.abs().sum() > 0


def test_wandb_logs_offline_by_default(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = config(tmp_path, max_steps=2, checkpoint_every=0, eval_every=0, log_every=1, report_to="wandb")
    Trainer(cfg, DummyHead(), TrainData(train=random_samples(8))).fit(progress=False)
    out = tmp_path / "run"
    runs = list((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and (out / "wandb_id").read_text().strip() in runs[0].name
    assert not list(out.glob("checkpoints/step-*"))  # checkpoint_every=0: none


@pytest.mark.parametrize("kind", ["medusa1", "eagle1", "eagle3", "medusa2"])
def test_real_heads_train_in_bf16_autocast(tmp_path, kind, isolated_cache):
    """mixed_precision=bf16 (the smollm2 presets' setting): finite losses, fp32 master weights."""
    from drafthead.train.loop.run import build_trainer
    from drafthead.train.data.tiny import tiny_target, tiny_tokenizer, write_tiny_jsonl

    tok = tiny_tokenizer()
    chats = write_tiny_jsonl(tmp_path / "chats.jsonl", 24)
    cfg = TrainConfig.from_dict(
        dict(
            target="tiny",
            head={"kind": kind},
            report_to="none",
            output_dir=str(tmp_path / "run"),
            mixed_precision="bf16",
            data={"source": "json", "path": str(chats), "max_length": 48},
            batch_size=4,
            max_steps=3,
            eval_every=3,
            checkpoint_every=0,
            log_every=1,
        )
    )
    trainer = build_trainer(cfg, tiny_target(tok), tok)
    result = trainer.fit(progress=False)
    assert all(p.dtype == torch.float32 for p in trainer.head.parameters())
    assert math.isfinite(result.train_metrics["loss"]) and math.isfinite(result.eval_metrics["loss"])


def test_a_run_continues_from_a_saved_head_and_refuses_another_architecture(tmp_path, isolated_cache):
    """init_from: the saved weights (and EAGLE-3 draft vocab) are the starting point, in float32
    even from a target loaded in bf16; loss-only fields may change; anything that shapes the
    weights may not; medusa2 (adapter) is refused."""
    from drafthead.heads.registry import load_head
    from drafthead.train.loop.config import ConfigError
    from drafthead.train.loop.run import build_trainer
    from drafthead.train.data.tiny import tiny_target, tiny_tokenizer, write_tiny_jsonl

    tok = tiny_tokenizer()
    chats = write_tiny_jsonl(tmp_path / "chats.jsonl", 24)

    def cfg(out: str, **kw) -> TrainConfig:
        base = dict(
            target="tiny",
            head={"kind": "eagle3", "draft_vocab_size": 64, "ttt_steps": 2},
            report_to="none",
            output_dir=str(tmp_path / out),
            data={"source": "json", "path": str(chats), "max_length": 48},
            batch_size=4,
            max_steps=3,
            eval_every=0,
            checkpoint_every=0,
            log_every=1,
            lr=1e-2,
        )
        return TrainConfig.from_dict({**base, **kw})

    first = build_trainer(cfg("first"), tiny_target(tok), tok).fit(progress=False)
    saved, _ = load_head(first.final_dir, tiny_target(tok), tok, dtype=torch.float32)

    bf16_target = tiny_target(tok).to(torch.bfloat16)
    again = build_trainer(
        cfg("again", init_from=str(first.final_dir), head={"kind": "eagle3", "draft_vocab_size": 64, "ttt_steps": 3}), bf16_target, tok
    )
    assert again.head.config.ttt_steps == 3
    for (name, a), (_, b) in zip(again.head.state_dict().items(), saved.state_dict().items()):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert again.fit(progress=False).train_metrics["loss"] < 50
    with pytest.warns(UserWarning, match="seed 0 -> 1: the eval split differs"):  # eval would score trained-on samples
        build_trainer(cfg("reseeded", init_from=str(first.final_dir), seed=1), tiny_target(tok), tok)

    with pytest.raises(ConfigError, match="draft_vocab_size: 32 != 64"):
        build_trainer(cfg("other", init_from=str(first.final_dir), head={"kind": "eagle3", "draft_vocab_size": 32}), tiny_target(tok), tok)
    with pytest.raises(ConfigError, match="kind: eagle1 != eagle3"):
        build_trainer(cfg("kind", init_from=str(first.final_dir), head={"kind": "eagle1"}), tiny_target(tok), tok)
    with pytest.raises(ConfigError, match="not supported for medusa2"):
        build_trainer(cfg("m2", init_from=str(first.final_dir), head={"kind": "medusa2"}), tiny_target(tok), tok)


def test_streaming_run_reads_lazily_and_resumes_exactly(tmp_path, isolated_cache):
    """data.streaming: the trainer reads a TokenStream (train/data/streaming.py) in its seeded order,
    across an epoch boundary; a run stopped after step 5 (checkpoint at 4) and resumed ends with
    the uninterrupted run's weights, and the eval set is the stream's first samples."""
    from drafthead.train.loop.run import build_trainer
    from drafthead.train.data.streaming import TokenStream
    from drafthead.train.data.tiny import tiny_target, tiny_tokenizer, write_tiny_jsonl

    tok = tiny_tokenizer()
    chats = write_tiny_jsonl(tmp_path / "chats.jsonl", 30)

    def trainer(name):
        cfg = TrainConfig.from_dict(
            dict(
                target="tiny",
                head={"kind": "eagle3", "draft_vocab_size": 64, "ttt_steps": 2},
                report_to="none",
                output_dir=str(tmp_path / name),
                batch_size=4,
                max_steps=10,
                eval_every=5,
                checkpoint_every=4,
                log_every=1,
                lr=1e-2,
                data={"source": "json", "path": str(chats), "max_length": 64, "eval_size": 6, "streaming": True, "shuffle_buffer": 8},
            )
        )
        return build_trainer(cfg, tiny_target(tok), tok, target_name="tiny")

    straight = trainer("straight")
    assert isinstance(straight.data.train, TokenStream) and len(straight.data.eval) == 6
    assert straight.batches_per_epoch() == (30 - 6) // 4  # 6 per epoch: 10 steps cross into epoch 2
    straight.fit(progress=False)
    stopped = trainer("resumed")
    assert stopped.fit(progress=False, stop_after_steps=5).final_dir is None
    resumed = trainer("resumed")
    result = resumed.fit(progress=False, resume=True)
    assert result.state.step == 10 and result.state.epoch == 1
    for (name, a), (_, b) in zip(straight.head.state_dict().items(), resumed.head.state_dict().items()):
        assert torch.equal(a, b), name
    with pytest.raises(ConfigError, match="captured"):
        TrainConfig.from_dict(
            dict(target="tiny", head={"kind": "eagle3"}, data={"streaming": True}, features={"mode": "captured", "path": str(tmp_path)})
        )


def test_auto_precision_follows_the_hardware():
    from drafthead.ground.target.load import has_native_bf16, resolve_dtype
    from drafthead.train.loop.trainer import resolve_mixed_precision

    assert resolve_mixed_precision("auto", True) == "bf16" and resolve_mixed_precision("auto", False) == "no"
    assert resolve_mixed_precision("fp16", False) == "fp16" and resolve_mixed_precision("no", True) == "no"
    assert resolve_dtype("auto", "cpu") == (torch.bfloat16 if has_native_bf16("cpu") else torch.float32)
    assert resolve_dtype("bfloat16", "cpu") == torch.bfloat16
