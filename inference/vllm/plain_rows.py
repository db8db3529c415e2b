"""The same prompts through vLLM's CPU build, plain, one request at a time, greedy: the vLLM row
of `drafthead bench --compare vllm` and of scripts/interop/compare_engines.py.

vLLM lives in its own venv (interpreter.py) and cannot share this process's torch, so a child
process of that venv's Python runs plain_child.py on a spec file and writes its rows back. Where that venv is absent (an
installed wheel has none) the engine is skipped, with the reason.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from . import interpreter

CHILD = Path(__file__).with_name("plain_child.py")
VLLM_ROW = "vLLM CPU plain"


def run_vllm(target: Path, prompts: list[list[int]], eos: list[int], max_new_tokens: int, dtype: str, threads: int, work: Path) -> list[dict]:
    """One row per prompt ({tokens, seconds, token_ids}) from the child in vLLM's venv."""
    spec = work / "vllm_spec.json"
    spec.write_text(json.dumps({"target": str(target), "dtype": dtype, "max_new_tokens": max_new_tokens, "prompts": prompts, "eos": eos}))
    log, python = work / "vllm.log", interpreter.VLLM_PYTHON
    with open(log, "w") as f:
        rc = subprocess.run(
            [str(python), str(CHILD), str(spec)], env=interpreter.child_env(python, threads), stdout=f, stderr=subprocess.STDOUT, timeout=3600
        ).returncode
    if rc:
        raise RuntimeError(f"vLLM child failed (rc {rc}), see {log}")
    return json.loads(spec.with_suffix(".out.json").read_text())


def vllm_rows(target: Path, prompts: list[list[int]], eos: list[int], max_new_tokens: int, dtype: str, threads: int, work: Path) -> tuple[dict, dict]:
    """The same prompts (token ids) through vLLM. Returns ({engine: rows}, {engine: why it was skipped})."""
    if not interpreter.VLLM_PYTHON.exists():
        return {}, {"vllm": "not installed (make interop, or scripts/interop/setup_vllm.sh)"}
    work.mkdir(parents=True, exist_ok=True)
    return {VLLM_ROW: run_vllm(target, prompts, eos, max_new_tokens, dtype, threads, work)}, {}
