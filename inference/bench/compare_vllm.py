"""The same prompts through vLLM's CPU build, plain, one request at a time, greedy: the vLLM row
of `drafthead bench --compare vllm` and of scripts/interop/compare_engines.py.

vLLM lives in its own venv (scripts/interop/setup_vllm.sh, `make interop`, in a source checkout:
.venv-interop/vllm) and cannot share this process's torch, so a child process of that venv's
Python runs vllm_child.py on a spec file and writes its rows back. Where that venv is absent (an
installed wheel has none) the engine is skipped, with the reason.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from . import vllm_child

VLLM_PYTHON = Path(__file__).resolve().parents[2] / ".venv-interop" / "vllm" / "bin" / "python"
VLLM_ROW = "vLLM CPU plain"


def child_env(python: Path, threads: int) -> dict[str, str]:
    """The environment of a child run by `python`, the Python of a vLLM venv."""
    env = {**os.environ, **vllm_child.CHILD_ENV, "OMP_NUM_THREADS": str(threads)}
    lib = python.parents[1] / "lib" / "libiomp5.so"  # Intel OpenMP, which vLLM's CPU build wants preloaded
    if lib.exists():
        env["LD_PRELOAD"] = str(lib)
    return env


def run_vllm(target: Path, prompts: list[list[int]], eos: list[int], max_new_tokens: int, dtype: str, threads: int, work: Path) -> list[dict]:
    """One row per prompt ({tokens, seconds, token_ids}) from the child in vLLM's venv."""
    spec = work / "vllm_spec.json"
    spec.write_text(json.dumps({"target": str(target), "dtype": dtype, "max_new_tokens": max_new_tokens, "prompts": prompts, "eos": eos}))
    log = work / "vllm.log"
    with open(log, "w") as f:
        rc = subprocess.run(
            [str(VLLM_PYTHON), vllm_child.__file__, str(spec)], env=child_env(VLLM_PYTHON, threads), stdout=f, stderr=subprocess.STDOUT, timeout=3600
        ).returncode
    if rc:
        raise RuntimeError(f"vLLM child failed (rc {rc}), see {log}")
    return json.loads(spec.with_suffix(".out.json").read_text())


def vllm_rows(target: Path, prompts: list[list[int]], eos: list[int], max_new_tokens: int, dtype: str, threads: int, work: Path) -> tuple[dict, dict]:
    """The same prompts (token ids) through vLLM. Returns ({engine: rows}, {engine: why it was skipped})."""
    if not VLLM_PYTHON.exists():
        return {}, {"vllm": "not installed (make interop, or scripts/interop/setup_vllm.sh)"}
    work.mkdir(parents=True, exist_ok=True)
    return {VLLM_ROW: run_vllm(target, prompts, eos, max_new_tokens, dtype, threads, work)}, {}
