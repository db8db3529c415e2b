"""The GPU check's CPU dry run (scripts/gpu/check.sh --dry-run): staging without wheels, one
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
