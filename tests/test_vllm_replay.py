"""Replayed acceptance counted as vLLM counts (inference/bench/replay.py VLLM) against vLLM's own
per-request metrics: the shipped EAGLE-3 head, exported to vLLM's layout, served by vLLM's CPU
build as a chain of 3 in fp32 on MT-bench prompts (scripts/interop/check_vllm.py), then replayed on
the answers vLLM served (scripts/studies/replay_vs_vllm.py). Marked `vllm` (`make test-vllm`).
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from drafthead.inference.vllm.capture import venv_python
from tests.cli_checks import run_cli

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[1]


def test_replay_counted_as_vllm_gives_vllms_steps(tmp_path, capsys):
    from drafthead.proposers import default_head_path
    from drafthead.ground.target.load import target_folder

    export = tmp_path / "head-vllm"
    assert run_cli(capsys, "export", str(default_head_path("smollm2-135m")), "--format", "vllm", "--out", export)[0] == 0
    served = tmp_path / "served"
    subprocess.run(
        [
            str(venv_python(None)),
            str(ROOT / "scripts/interop/check_vllm.py"),
            "--target",
            str(target_folder("smollm2-135m")[0]),
            "--head",
            str(export),
            "--method",
            "eagle3",
            "--num-spec-tokens",
            "3",
            "--prompts",
            "6",
            "--max-tokens",
            "96",
            "--dtype",
            "float32",
            "--skip-plain",
            "--out",
            str(served),
        ],
        check=True,
        timeout=900,
        stdout=subprocess.DEVNULL,
    )
    report = tmp_path / "report.json"
    subprocess.run(
        [sys.executable, str(ROOT / "scripts/studies/replay_vs_vllm.py"), "--vllm", f"{served}.json", "--out", str(report)], check=True, timeout=900
    )
    r = json.loads(report.read_text())
    measured, replayed = r["vllm_measured"], r["replayed"]["vllm"]
    print("\nvLLM", measured, "\nreplayed as vLLM", replayed, "\nreplayed as ours", r["replayed"]["drafthead"])
    assert r["steps"] == measured["steps"] > 0
    assert measured["tau"] > 1.1  # the head's drafts were accepted: the comparison saw acceptance
    assert r["steps_equal"] >= 0.98 * r["steps"], r["partings"]
    assert replayed["tau"] == pytest.approx(measured["tau"], rel=0.01)
