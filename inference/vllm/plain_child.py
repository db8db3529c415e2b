"""vLLM's side of `bench --compare vllm` (inference/vllm/plain_rows.py), run as a script by the
Python of vLLM's own venv, which has no drafthead: it imports only the standard library and vLLM
(and, run as a script, finds this folder first on sys.path, so no module here may be named vllm
or as a module vLLM imports).

    VLLM_PYTHON plain_child.py SPEC.json      writes SPEC.out.json: one row per prompt

SPEC holds the target folder, dtype, max_new_tokens, the prompts as token ids and the stop ids.
Each prompt is generated greedily, one request at a time, timed wall to wall around `generate`
(engine start and a warm-up excluded).
"""

import json
import sys
import time
from pathlib import Path


def main(spec_path: str) -> int:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    spec = json.loads(Path(spec_path).read_text())
    llm = LLM(
        model=spec["target"],
        tokenizer=spec["target"],
        dtype=spec["dtype"],
        max_model_len=2048,
        seed=0,
        kv_cache_memory_bytes=1 << 30,
        enforce_eager=True,
        enable_prefix_caching=False,
        max_num_seqs=1,
    )
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_new_tokens"], stop_token_ids=spec["eos"])
    llm.generate([TokensPrompt(prompt_token_ids=spec["prompts"][0])], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)  # warm-up
    rows = []
    for ids in spec["prompts"]:
        start = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
        rows.append(
            {"tokens": len(out[0].outputs[0].token_ids), "seconds": time.perf_counter() - start, "token_ids": list(out[0].outputs[0].token_ids)}
        )
    Path(spec_path).with_suffix(".out.json").write_text(json.dumps(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1]))
