"""vLLM's side of `data capture --backend vllm` (inference/vllm/capture.py), run as a script by the
Python of vLLM's own venv, which has no drafthead: it imports only the standard library, torch,
safetensors and vLLM (and, run as a script, finds this folder first on sys.path, so no module here
may be named vllm).

    VLLM_PYTHON capture_child.py SPEC.json

SPEC holds the target folder, dtype, the vLLM aux-layer ids, max_model_len, the KV cache bytes and
the folder vLLM writes into. The engine is built once: vLLM's `extract_hidden_states` speculative
method with `eagle_aux_hidden_state_layer_ids` = the ids, and its hidden-states KV connector
(docs/models-and-data.md "Capturing through vLLM"). Then each stdin line {"prompts": [[ids]]}
runs those prompts (one token generated each, greedy) and is answered on stdout by one line
{"files": [path per prompt]}: safetensors files of `hidden_states` [T, n_ids, H] (ids ascending)
and `token_ids` [T]. The first stdout line is {"ready": vLLM's version}. Everything vLLM prints
goes to stderr, so stdout carries only these lines.
"""

import fcntl
import json
import os
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import ExampleHiddenStatesConnector, extract_from_kv_cache


class _Written:
    """Stands for the CUDA event the stock connector polls: the write has already happened."""

    @staticmethod
    def query() -> bool:
        return True


class CpuHiddenStatesConnector(ExampleHiddenStatesConnector):
    """vLLM's ExampleHiddenStatesConnector with its write done in place. The stock one copies the
    request's cache rows to pinned host memory on a CUDA stream and writes from a thread; on the
    CPU build the pinned buffer raises (docs/models-and-data.md). Everything else (which rows, the
    file's name, its lock, when it is written) is the stock connector's."""

    def _submit_async_write(self, pending) -> None:
        if not self._is_tp_rank_zero:
            return
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        slots = (torch.arange(self._block_size)[None] + blocks[:, None] * self._block_size).flatten()
        hidden = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0]).clone()  # [T, n_ids, H]
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        try:
            save_file({"hidden_states": hidden, "token_ids": pending.token_ids.clone()}, pending.filename)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)  # releases the lock the client waits on
        self._req_copy_events[pending.req_id] = _Written()


def wait_written(path: str) -> None:
    """Block until the connector has released the file's lock (it writes a step after the
    request's output comes back), then drop the lock file."""
    lock = path + ".lock"
    if os.path.exists(lock):
        with open(lock) as f:
            fcntl.flock(f, fcntl.LOCK_SH)
        os.remove(lock)


def main(spec_path: str) -> int:
    reply = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # vLLM's prints go to stderr; stdout is ours
    from vllm import LLM, SamplingParams, __version__
    from vllm.inputs import TokensPrompt

    spec = json.loads(Path(spec_path).read_text())
    llm = LLM(
        model=spec["target"],
        tokenizer=spec["target"],
        dtype=spec["dtype"],
        max_model_len=spec["max_model_len"],
        seed=0,
        kv_cache_memory_bytes=spec["kv_cache_bytes"],
        enforce_eager=True,
        enable_prefix_caching=False,
        speculative_config={
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": spec["ids"]}},
        },
        kv_transfer_config={
            "kv_connector": "CpuHiddenStatesConnector",
            "kv_connector_module_path": Path(__file__).stem,
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"shared_storage_path": spec["out"]},
        },
    )
    params = SamplingParams(temperature=0.0, max_tokens=1)
    reply.write(json.dumps({"ready": __version__}) + "\n")
    for line in sys.stdin:
        prompts = json.loads(line)["prompts"]
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        files = [o.kv_transfer_params["hidden_states_path"] for o in outputs]  # in prompt order
        for path in files:
            wait_written(path)
        reply.write(json.dumps({"files": files}) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1]))
