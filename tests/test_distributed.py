"""Training on 2 CPU processes (gloo) and after real crashes (docs/scaling.md):

* DDP and FSDP runs end with one process's weights, with the same global batch;
* a 2-process FSDP run whose rank is SIGKILLed after a checkpoint resumes to the uninterrupted
  run's weights, bit for bit, and only the main process writes;
* a single-process run SIGKILLed mid-run resumes bit-equal, in fp32 and under bf16 autocast.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from drafthead.train.data.tiny import save_tiny_target, write_tiny_jsonl
from tests.dist_worker import equal_length_trainer, tiny_config
from tests.launch import accelerate_launch, run_group, start_group, stop_group

pytestmark = pytest.mark.subprocess  # starts processes of its own (pyproject.toml markers)

REPO = Path(__file__).resolve().parent.parent
KILLED_RUN = {"parallelism": "fsdp", "max_steps": 8, "checkpoint_every": 1, "eval_every": 4}  # as tests/dist_worker.py's cli-fsdp


def env_for(tmp: Path) -> dict:
    return dict(
        os.environ,
        ACCELERATE_USE_CPU="1",
        OMP_NUM_THREADS="1",
        DRAFTHEAD_CACHE=str(tmp / "cache"),
        WANDB_MODE="disabled",
        PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "final" / "model.safetensors"))


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (from /proc), children first."""
    parent_of = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent_of[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    found, frontier = [], [pid]
    while frontier:
        kids = [p for p, pp in parent_of.items() if pp in frontier]
        found += kids
        frontier = kids
    return found


def latest_step(run_dir: Path) -> int:
    pointer = run_dir / "checkpoints" / "latest"
    try:
        return int(pointer.read_text().strip().removeprefix("step-"))
    except (OSError, ValueError):
        return 0


def run_until_checkpoint(cmd: list[str], run_dir: Path, env: dict, step: int, kill) -> subprocess.CompletedProcess:
    """Start `cmd`, wait until its newest checkpoint is `step` or later, SIGKILL `kill(proc)`
    (one pid), wait for the launcher to end. The run must not have finished on its own."""
    proc = start_group(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 120
        while latest_step(run_dir) < step:
            assert proc.poll() is None, f"the run ended before checkpoint {step}: {proc.stdout.read()[-3000:]}"
            assert time.time() < deadline, "no checkpoint within 120 s"
            time.sleep(0.005)
        os.kill(kill(proc), signal.SIGKILL)
        out, _ = proc.communicate(timeout=120)
    finally:
        stop_group(proc)
        proc.wait()
    assert not (run_dir / "final").exists(), "the run finished before the kill: nothing was interrupted"
    return subprocess.CompletedProcess(cmd, proc.returncode, out, "")


@pytest.fixture(scope="module")
def tiny_run_inputs(run_once):
    """(folder, target, chats): one tiny target and chat file for the whole test run."""

    def make(folder: Path) -> None:
        save_tiny_target(folder / "target")
        write_tiny_jsonl(folder / "chats.jsonl", 48)

    tmp = run_once("dist-inputs", make)
    return tmp, str(tmp / "target"), str(tmp / "chats.jsonl")


@pytest.fixture(scope="module")
def two_process_runs(run_once, tiny_run_inputs):
    """OUT of one `accelerate launch` of tests/dist_worker.py (see its docstring), once a test run."""
    tmp, target, chats = tiny_run_inputs

    def launch(folder: Path) -> None:
        cmd = accelerate_launch() + [str(REPO / "tests" / "dist_worker.py"), str(folder / "worker"), target, chats]
        proc = run_group(cmd, 300, cwd=REPO, env=env_for(folder))
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    return run_once("dist-runs", launch) / "worker"


def test_ddp_and_fsdp_end_with_the_weights_of_one_process(two_process_runs, tiny_run_inputs):
    from drafthead.ground.target.load import load_target

    tmp, target, chats = tiny_run_inputs
    threads = torch.get_num_threads()
    try:  # one process, batch 4 = 2 ranks x batch 2, same 3 steps
        cfg = tiny_config(target, chats, tmp / "one", batch_size=4, max_steps=3, checkpoint_every=0, eval_every=0, warmup_steps=0)
        loaded = load_target(cfg.target, dtype=cfg.target_dtype, threads=1)
        trainer = equal_length_trainer(cfg, loaded.model, loaded.tokenizer)
        initial = {k: v.clone() for k, v in trainer.head.state_dict().items()}
        trainer.fit(progress=False)
    finally:
        torch.set_num_threads(threads)
    one = weights(tmp / "one")
    assert max(float((one[k].float() - initial[k].float()).abs().max()) for k in one) > 1e-3  # training moved the head
    # cp: one process's batches, each row split between the ranks, the target's forward too. Its
    # attention sums the same terms in another order (features equal within 1e-6,
    # tests/test_split_target.py), and AdamW's normalised step turns that into up to 1e-4 of the
    # weights where a gradient is near zero (lr 3e-3, 3 steps)
    for parallelism, tolerance in (("ddp", 1e-5), ("fsdp", 1e-5), ("cp", 1e-4), ("fsdp-cp", 1e-4)):
        other = weights(two_process_runs / parallelism)
        assert set(other) == set(one)
        diff = max(float((one[k].float() - other[k].float()).abs().max()) for k in one)
        assert diff < tolerance, (parallelism, diff)
    cp_start = json.loads((two_process_runs / "cp" / "metrics.jsonl").read_text().splitlines()[0])
    assert cp_start["parallelism"] == "ddp+cp2" and cp_start["batches_per_epoch"] == 4  # 16 samples / batch 4, 1 replica
    assert cp_start["target_forward"] == "split across 2 ranks"
    assert json.loads((two_process_runs / "fsdp-cp" / "metrics.jsonl").read_text().splitlines()[0])["parallelism"] == "fsdp+cp2"
    cp_rows = [json.loads(line) for line in (two_process_runs / "cp" / "metrics.jsonl").read_text().splitlines()]
    one_rows = [json.loads(line) for line in (tmp / "one" / "metrics.jsonl").read_text().splitlines()]
    cp_train = [r for r in cp_rows if r.get("split") == "train"]
    one_train = [r for r in one_rows if r.get("split") == "train"]
    assert [r["loss"] for r in cp_train] == pytest.approx([r["loss"] for r in one_train], rel=1e-5)
    assert [r["acc_0"] for r in cp_train] == pytest.approx([r["acc_0"] for r in one_train], rel=1e-5)
    ddp_start = json.loads((two_process_runs / "ddp" / "metrics.jsonl").read_text().splitlines()[0])
    assert ddp_start["world_size"] == 2 and "MULTI_CPU" in ddp_start["distributed_type"] and ddp_start["parallelism"] == "ddp"
    start = json.loads((two_process_runs / "fsdp" / "metrics.jsonl").read_text().splitlines()[0])
    # the head is split between the 2 ranks; the target's decoder layers are too (embeddings stay whole)
    assert start["parallelism"] == "fsdp" and start["world_size"] == 2
    head_total = sum(p.numel() for p in trainer.head.parameters())
    target_total = sum(p.numel() for p in loaded.model.parameters())
    assert start["head_params_local"] <= head_total // 2 + 64
    assert start["target_params_local"] < 0.75 * target_total
    # a stream read by 2 ranks: both reach the end of epoch 1 together (no hang) and finish
    stream_start = json.loads((two_process_runs / "stream-ddp" / "metrics.jsonl").read_text().splitlines()[0])
    assert stream_start["world_size"] == 2 and stream_start["batches_per_epoch"] == 5
    assert (two_process_runs / "stream-ddp" / "final" / "model.safetensors").exists()


def test_fsdp_rank_killed_after_a_checkpoint_resumes_bit_equal(two_process_runs, tiny_run_inputs):
    tmp, target, chats = tiny_run_inputs
    run = tmp / "killed-fsdp"
    overrides = [f"{k}={v}" for k, v in dict(KILLED_RUN, target=target, **{"data.path": chats}, output_dir=run, threads=1).items()]
    cmd = accelerate_launch() + ["-m", "drafthead", "train", "--config", str(REPO / "configs" / "tiny-eagle3.yaml"), *overrides]

    def a_rank(proc):  # one of the two training processes under the launcher
        ranks = [p for p in descendants(proc.pid) if b"drafthead\x00train" in Path(f"/proc/{p}/cmdline").read_bytes()]
        assert len(ranks) >= 2, ranks
        return ranks[-1]

    killed = run_until_checkpoint(cmd, run, env_for(tmp), 3, a_rank)
    assert killed.returncode != 0
    resumed = subprocess.run(cmd + ["--resume"], cwd=REPO, env=env_for(tmp), capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]

    reference, ours = weights(two_process_runs / "cli-fsdp"), weights(run)
    assert set(reference) == set(ours)
    for k in reference:
        assert torch.equal(reference[k], ours[k]), k
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["event"] for r in records if r.get("event") in ("start", "resume")] == ["start", "resume"]  # only rank 0 logs
    state = json.loads((run / "checkpoints" / "step-00000008" / "trainer_state.json").read_text())
    assert state["world_size"] == 2 and state["parallelism"] == "fsdp"
    assert len(torch.load(run / "checkpoints" / "step-00000008" / "rng.pt", weights_only=False)) == 2  # both ranks' RNG


@pytest.mark.parametrize("precision", ["no", "bf16"])
def test_sigkill_mid_run_resumes_bit_equal(tmp_path, tiny_run_inputs, precision):
    """The run is a subprocess killed with SIGKILL; the reference and the resume run here."""
    from drafthead.train.loop.run import run_training

    _, target, chats = tiny_run_inputs
    settings = dict(max_steps=12, checkpoint_every=1, eval_every=6)
    if precision != "no":  # the default; a bare `no` would read as YAML false
        settings["mixed_precision"] = precision
    run = tmp_path / "killed"
    overrides = [f"{k}={v}" for k, v in dict(settings, target=target, **{"data.path": chats}, output_dir=run, threads=1).items()]
    cmd = [sys.executable, "-m", "drafthead", "train", "--config", str(REPO / "configs" / "tiny-eagle3.yaml"), *overrides]
    killed = run_until_checkpoint(cmd, run, env_for(tmp_path), 3, lambda proc: proc.pid)
    assert killed.returncode == -signal.SIGKILL

    threads = torch.get_num_threads()
    try:
        run_training(tiny_config(target, chats, tmp_path / "straight", **settings), say=lambda message: None)
        result = run_training(tiny_config(target, chats, run, **settings), resume=True, say=lambda message: None)
    finally:
        torch.set_num_threads(threads)
    assert result.state.step == 12
    events = [json.loads(x).get("event") for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert events.count("resume") == 1
    reference, ours = weights(tmp_path / "straight"), weights(run)
    for k in reference:
        assert torch.equal(reference[k], ours[k]), k
