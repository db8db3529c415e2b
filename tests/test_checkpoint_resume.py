"""An interrupted-then-resumed run ends with exactly the weights of an uninterrupted one.

Tolerance: zero (bitwise equal), single process, fp32 on CPU. The dummy head uses dropout, so
the torch RNG must be restored; grad accumulation 2 over 5 batches per epoch makes steps straddle
epoch boundaries, so the data position (epoch, batch index, sampler seed) must be restored too.
"""

from __future__ import annotations

import json

import pytest
import torch

from drafthead.train.loop.checkpoint import latest_checkpoint, load_checkpoint
from drafthead.train.loop.trainer import Trainer, TrainData
from tests.trainer_checks import DummyHead, config, random_samples


def make(tmp_path, name):
    torch.manual_seed(123)  # same initial head in every run
    head = DummyHead()
    samples = random_samples(24, seed=7)
    data = TrainData(train=samples[:20], eval=samples[20:])
    cfg = config(tmp_path / name, max_steps=12, grad_accum=2, checkpoint_every=4, eval_every=3, log_every=1, lr=1e-2)
    return cfg, head, data


def test_resume_is_exact(tmp_path):
    cfg, head_a, data = make(tmp_path, "straight")
    Trainer(cfg, head_a, data).fit(progress=False)

    cfg_b, head_b, data_b = make(tmp_path, "interrupted")
    partial = Trainer(cfg_b, head_b, data_b).fit(progress=False, stop_after_steps=6)  # dies after step 6
    assert partial.final_dir is None and partial.state.step == 6
    ckpt = latest_checkpoint(cfg_b.output_dir)
    assert ckpt.name == "step-00000004"  # steps 5 and 6 are lost, as in a crash
    state = load_checkpoint(ckpt).state
    assert (state.step, state.micro_step, state.epoch, state.batch_index) == (4, 8, 1, 3)

    torch.manual_seed(999)  # a different process: fresh RNG and a differently initialised head
    head_c = DummyHead()
    result = Trainer(cfg_b, head_c, data_b).fit(progress=False, resume=True)
    assert result.state.step == 12 and result.final_dir is not None

    for (name, a), (_, c) in zip(head_a.state_dict().items(), head_c.state_dict().items()):
        assert torch.equal(a, c), name

    # the logged training losses after the resume point match the uninterrupted run's
    def losses(run):
        rows = [json.loads(x) for x in (tmp_path / run / "run" / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: r["loss"] for r in rows if r.get("split") == "train"}

    straight, resumed = losses("straight"), losses("interrupted")
    assert all(straight[s] == resumed[s] for s in range(5, 13))


def test_resume_without_checkpoint_starts_fresh_and_resume_refuses_other_world_size(tmp_path):
    cfg, head, data = make(tmp_path, "fresh")
    result = Trainer(cfg, head, data).fit(progress=False, resume=True, stop_after_steps=4)
    assert result.state.step == 4
    # pretend the checkpoint came from a 2-process run: the data order would differ
    ckpt = latest_checkpoint(cfg.output_dir)
    state_file = ckpt / "trainer_state.json"
    state = json.loads(state_file.read_text())
    state_file.write_text(json.dumps(dict(state, world_size=2)))
    with pytest.raises(ValueError, match="2 process"):
        Trainer(cfg, DummyHead(), data).fit(progress=False, resume=True)


def test_interrupted_checkpoint_write_is_ignored(tmp_path):
    cfg, head, data = make(tmp_path, "torn")
    Trainer(cfg, head, data).fit(progress=False, stop_after_steps=4)
    root = latest_checkpoint(cfg.output_dir).parent
    torn = root / ".tmp-step-00000008-1"  # what a crash during a write leaves
    torn.mkdir()
    (torn / "trainable.safetensors").write_bytes(b"partial")
    assert latest_checkpoint(cfg.output_dir).name == "step-00000004"
