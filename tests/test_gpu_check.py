"""The CPU dry runs of the GPU check (scripts/gpu/check.sh --dry-run) and of the GPU run
(scripts/gpu/run.sh --dry-run). The check's: staging without wheels, one
training step of an EAGLE-3 head on a target of SmolLM2-135M's shapes with random weights at two
short lengths (the long-context step) and for the training run, and its bench, ending in the
summary line. What the GPU run does, short of the device and of tests/test_cuda.py, which `make
test` runs on the CPU itself (docs/testing.md "On a GPU")."""

import json
import os
import subprocess
import sys
from pathlib import Path
import pytest

pytestmark = pytest.mark.subprocess  # starts processes of its own (pyproject.toml markers)

REPO = Path(__file__).resolve().parents[1]


def test_the_gpu_check_runs_dry_on_the_cpu(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(["bash", str(REPO / "scripts/gpu/check.sh"), "--dry-run"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["device"] == "cpu" and summary["steps"] == 1 and summary["loss"] > 0
    assert summary["bench"]["identical_fraction"] == 1.0
    lengths = [json.loads(line) for line in (tmp_path / "long_context.jsonl").read_text().splitlines()]
    assert [r["tokens"] for r in lengths] == [64, 128] and all(r["loss"] > 0 for r in lengths)


@pytest.mark.slow  # the real target: its weights' digest, its answers, a head trained on them
def test_the_gpu_run_goes_dry_on_the_cpu(tmp_path):
    """scripts/gpu/run.sh --dry-run: the bundle staged in parts that each fit a call beside the
    checkout, carried one a call to a folder standing for the device, the GPU run's phases at the
    dry budget (the real target's weights checked, answers, two training steps, the head sent
    back in parts, the bench), and the head checked here."""
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(["bash", str(REPO / "scripts/gpu/run.sh"), "--dry-run"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    calls = [line for line in proc.stdout.splitlines() if 'run(command="bash scripts/gpu/run.sh"' in line]
    manifest = json.loads((tmp_path / "here/parts/manifest.json").read_text())
    assert len(calls) == len(manifest["parts"]) >= 3 and "timeout_s=600" in calls[-1]
    assert all(part["bytes"] <= manifest["part_bytes"] < 64 * 2**20 for part in manifest["parts"])
    staged = json.loads((tmp_path / "device/bundle/target.json").read_text())
    summary = json.loads((tmp_path / "back/summary.json").read_text())
    assert summary["device"] == "cpu" and summary["target"]["weights_sha256"] == staged["weights_sha256"]
    assert summary["regenerate"]["conversations"] == 8 and summary["train"]["steps"] == 2 and summary["train"]["loss"] > 0
    head_parts = json.loads((tmp_path / "back/head/manifest.json").read_text())["parts"]
    assert len(head_parts) >= 2 and all(part["bytes"] <= 16 * 2**20 for part in head_parts)
    assert all(method["identical"] == 1.0 for method in summary["bench"]["methods"].values())
    sent, back = tmp_path / "work/head", tmp_path / "checked/head"
    assert {p.name: p.read_bytes() for p in sent.iterdir()} == {p.name: p.read_bytes() for p in back.iterdir() if p.name != "received.json"}
    checked = json.loads((tmp_path / "checked/check.json").read_text())
    assert checked["new"]["rounds"] > 0 and checked["shipped"]["rounds"] == checked["new"]["rounds"]
