"""vLLM's OpenAI-compatible server (CPU build, from its own venv) on 127.0.0.1, for `data regenerate
--server` against a real vLLM in tests and studies (docs/models-and-data.md "Regenerating through a
server").
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

from .interpreter import child_env
from ..servers.local import local_server
from .capture import KV_CACHE_BYTES, venv_python


@contextmanager
def vllm_server(
    target: Path,
    *,
    dtype: str = "float32",
    name: str | None = None,
    max_model_len: int = 2048,
    max_num_seqs: int = 8,
    threads: int = 1,
    venv: str | Path | None = None,
    log: Path | None = None,
    kv_cache_bytes: int = KV_CACHE_BYTES,
    ready_within: float = 600.0,
):
    """vLLM serving the target folder on 127.0.0.1 inside the block, which gets its base URL;
    stopped on the way out. The model is served under `name` (default: the folder's path, vLLM's
    own default). Eager mode: no torch.compile at start."""
    python = venv_python(venv)

    def command(port: int) -> list:
        cmd = [
            python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            target,
            "--host",
            "127.0.0.1",
            "--port",
            port,
            "--dtype",
            dtype,
            "--max-model-len",
            max_model_len,
            "--max-num-seqs",
            max_num_seqs,
            "--kv-cache-memory-bytes",
            kv_cache_bytes,
            "--enforce-eager",
            "--seed",
            0,
        ]
        return cmd + (["--served-model-name", name] if name else [])

    with local_server(command, "vLLM's server", log=log, env=child_env(python, threads), ready_within=ready_within) as url:
        yield url
