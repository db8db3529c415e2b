"""Replayed acceptance during training (train/loop/replay_eval.py) and the best head by an eval metric
(train/loop/best.py): a run on a tiny target logs the engine's chain and tree tau at every eval, the
figures are the engine drafter's on the saved head, and keep_best keeps the step that scored
highest, across a resume too."""

from __future__ import annotations

import json

import pytest
import torch

from drafthead.train.loop.best import BEST_DIR, BEST_FILE, improves
from drafthead.train.loop.config import TrainConfig
from drafthead.train.loop.curves import EVAL_PLOT, eval_records, plot_eval_curves
from drafthead.train.loop.replay_eval import prompt_of
from drafthead.train.loop.trainer import Trainer, TrainData
from tests.trainer_checks import DummyHead, config, random_samples


def test_prompt_is_the_text_before_the_first_assistant_token():
    sample = {"input_ids": torch.tensor([5, 6, 7, 8, 9]), "loss_mask": torch.tensor([0, 0, 1, 0, 1], dtype=torch.bool)}
    assert prompt_of(sample).tolist() == [[5, 6]]
    assert prompt_of(dict(sample, loss_mask=torch.ones(5, dtype=torch.bool))) is None
    assert prompt_of(dict(sample, loss_mask=torch.zeros(5, dtype=torch.bool))) is None


def test_improves():
    assert improves(1.5, None) and improves(1.6, 1.5)
    assert not improves(1.5, 1.5) and not improves(1.4, 1.5)
    assert not improves(None, 1.0) and not improves(float("nan"), None)


def test_a_run_logs_replayed_tau_at_every_eval_as_the_engine_drafter_measures_it(tmp_path, isolated_cache):
    from drafthead.heads.registry import load_head
    from drafthead.inference.drafters.load import chain_settings, head_drafter
    from drafthead.inference.bench.replay import VLLM, replay_greedy
    from drafthead.train.loop.run import build_trainer
    from drafthead.train.data.tiny import tiny_target, tiny_tokenizer, write_tiny_jsonl

    tok = tiny_tokenizer()
    chats = write_tiny_jsonl(tmp_path / "chats.jsonl", 40)
    cfg = TrainConfig.from_dict(
        dict(
            target="tiny",
            head={"kind": "eagle3", "draft_vocab_size": 64, "ttt_steps": 2},
            report_to="none",
            output_dir=str(tmp_path / "run"),
            data={"source": "json", "path": str(chats), "max_length": 64, "eval_fraction": 0.1, "eval_size": 4},
            replay={"sequences": 3, "max_new_tokens": 12, "chain": 2},
            keep_best="replay_tau",
            batch_size=4,
            max_steps=6,
            eval_every=3,
            checkpoint_every=0,
            log_every=3,
            lr=1e-2,
            warmup_steps=1,
        )
    )
    target = tiny_target(tok)
    trainer = build_trainer(cfg, target, tok, target_name="tiny")
    result = trainer.fit(progress=False)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if r.get("split") == "eval"]
    assert [r["step"] for r in evals] == [3, 6]
    held_out = trainer.replay.held_out(())
    assert len(held_out) == 3
    continuation_tokens = sum(h.end - h.prompt_len for h in held_out)
    assert all(h.sequence.shape[1] == h.end + 2 for h in held_out)  # the chain's tokens past each answer
    for r in evals:
        assert {"tau_est", "replay_tau", "replay_tree_tau", "replay_vllm_tau", "replay_acc_0", "replay_acc_1"} <= set(r)
        # every round emits at least the target's token and together they cover each continuation
        assert r["replay_tau"] * r["replay_rounds"] == pytest.approx(continuation_tokens)
        assert 1.0 <= r["replay_vllm_tau"] <= 3.0
        assert 1.0 <= r["replay_tau"] <= 3.0 and r["replay_acc_1"] <= r["replay_acc_0"]
        by_context = {k: v for k, v in r.items() if k.startswith("replay_tau_ctx_")}
        assert by_context and all(1.0 <= v <= 3.0 for v in by_context.values())

    # the final eval's figures are those of the saved head in the engine's own drafter
    drafter = head_drafter(load_head(result.final_dir, target, tok)[0].eval(), chain_settings("eagle3", 2))
    accepted = [a for h in held_out for a in replay_greedy(drafter, h.sequence, h.prompt_len, h.hidden, h.end)]
    assert sum(accepted) / len(accepted) == pytest.approx(evals[-1]["replay_tau"])
    steps = [a for h in held_out for a in replay_greedy(drafter, h.sequence, h.prompt_len, h.hidden, h.end, VLLM)]
    assert sum(steps) / len(steps) == pytest.approx(evals[-1]["replay_vllm_tau"])
    best = json.loads((tmp_path / "run" / BEST_DIR / BEST_FILE).read_text())
    assert best["metric"] == "replay_tau" and best["value"] == max(r["replay_tau"] for r in evals)
    # the run ends with its eval curves drawn from those same lines
    assert (tmp_path / "run" / EVAL_PLOT).stat().st_size > 0
    assert [r["replay_tau"] for r in eval_records(tmp_path / "run" / "metrics.jsonl")] == [r["replay_tau"] for r in evals]


def test_eval_records_keep_the_last_line_of_a_repeated_step_and_no_plot_without_evals(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    lines = [
        {"step": 2, "split": "eval", "tau_est": 1.1},
        {"step": 2, "split": "train", "loss": 3.0},
        {"event": "resume"},
        {"step": 2, "split": "eval", "tau_est": 1.2},
        {"step": 1, "split": "eval", "tau_est": 1.0},
    ]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert [(r["step"], r["tau_est"]) for r in eval_records(metrics)] == [(1, 1.0), (2, 1.2)]
    metrics.write_text(json.dumps(lines[1]) + "\n")
    assert plot_eval_curves(metrics, tmp_path / "eval.png") is None and not (tmp_path / "eval.png").exists()


def test_a_chain_deeper_than_the_head_drafts_fails_before_training(tmp_path, isolated_cache):
    from drafthead.train.loop.config import ConfigError
    from drafthead.train.loop.run import build_trainer
    from drafthead.train.data.tiny import tiny_target, tiny_tokenizer, write_tiny_jsonl

    tok = tiny_tokenizer()
    cfg = TrainConfig.from_dict(
        dict(
            target="tiny",
            head={"kind": "medusa1", "num_heads": 2},
            report_to="none",
            output_dir=str(tmp_path / "run"),
            data={"source": "json", "path": str(write_tiny_jsonl(tmp_path / "chats.jsonl", 20)), "max_length": 64, "eval_fraction": 0.1},
            replay={"sequences": 2, "chain": 3},
            max_steps=2,
        )
    )
    with pytest.raises(ConfigError, match="replay: tree depth 3 exceeds the 2 Medusa heads"):
        build_trainer(cfg, tiny_target(tok), tok)


class ScriptedReplay:
    """Stands in for ReplayEval: replay_tau from a script, one value per eval, and a copy of the
    head's weights at each call."""

    def __init__(self, taus):
        self.taus, self.seen = list(taus), []

    def __call__(self, head):
        self.seen.append({k: v.clone() for k, v in head.state_dict().items()})
        return {"replay_tau": self.taus[len(self.seen) - 1]}


def test_keep_best_keeps_the_step_with_the_highest_replayed_tau_across_a_resume(tmp_path):
    samples = random_samples(48)
    data = TrainData(train=samples[:40], eval=samples[40:])

    def trainer(replay):
        cfg = config(tmp_path, max_steps=40, eval_every=10, checkpoint_every=10, keep_best="replay_tau", replay={"sequences": 1})
        torch.manual_seed(0)
        return Trainer(cfg, DummyHead(), data, replay=replay)

    first = ScriptedReplay([1.2, 1.9])
    trainer(first).fit(progress=False, stop_after_steps=20)
    again = ScriptedReplay([1.5, 1.7])  # the resumed run's evals at steps 30 and 40: neither beats 1.9
    trainer(again).fit(resume=True, progress=False)
    folder = tmp_path / "run" / BEST_DIR
    assert json.loads((folder / BEST_FILE).read_text()) == {"step": 20, "metric": "replay_tau", "value": 1.9}
    kept = torch.load(folder / "head.pt")
    assert all(torch.equal(kept[k], first.seen[1][k]) for k in kept)
    assert not all(torch.equal(kept[k], again.seen[1][k]) for k in kept)  # the head did change after step 20

    events = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e.get("event") == "best"] == [10, 20]
    assert [e["replay_tau"] for e in events if e.get("split") == "eval"] == [1.2, 1.9, 1.5, 1.7]
