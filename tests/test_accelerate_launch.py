"""`accelerate launch --multi_gpu --num_processes 2 -m drafthead.train` on CPU (docs/launching.md):
two gloo processes train a tiny config on a tiny random target, report world size 2, and only
the main process writes (one checkpoint, one final head, one metrics file)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from drafthead.train.tiny import save_tiny_target, write_tiny_jsonl

REPO = Path(__file__).resolve().parent.parent


def test_two_cpu_processes(tmp_path):
    target = save_tiny_target(tmp_path / "target")
    chats = write_tiny_jsonl(tmp_path / "chats.jsonl", 48)
    out = tmp_path / "run"
    env = dict(os.environ, ACCELERATE_USE_CPU="1", OMP_NUM_THREADS="1", DRAFTHEAD_CACHE=str(tmp_path / "cache"), WANDB_MODE="disabled")
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
        "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
        "-m", "drafthead.train", "--config", str(REPO / "configs" / "tiny-medusa1.yaml"),
        f"target={target}", f"data.path={chats}", f"output_dir={out}",
        "max_steps=2", "checkpoint_every=2", "eval_every=2", "threads=1",
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    start = [r for r in records if r.get("event") == "start"]
    assert len(start) == 1  # only the main process logs
    assert start[0]["world_size"] == 2 and "MULTI_CPU" in start[0]["distributed_type"]
    assert "world size 2" in proc.stdout + proc.stderr
    assert [p.name for p in (out / "checkpoints").iterdir() if p.is_dir()] == ["step-00000002"]
    state = json.loads((out / "checkpoints" / "step-00000002" / "trainer_state.json").read_text())
    assert state["world_size"] == 2 and state["step"] == 2 and state["micro_step"] == 2
    import torch

    rng = torch.load(out / "checkpoints" / "step-00000002" / "rng.pt", weights_only=False)
    assert len(rng) == 2  # both processes' RNG states, written by one
    assert (out / "final" / "config.json").exists()
    assert [r["step"] for r in records if r.get("split") == "eval"] == [2]
