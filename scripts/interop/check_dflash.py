"""Run an exported DFlash folder through z-lab's `dflash` package (run with the dflash venv).

    .venv-interop/dflash/bin/python scripts/interop/check_dflash.py --head DIR --target DIR \
        --prompts prompts.json --max-tokens 32 --out PREFIX

prompts.json: {"prompt_token_ids": [[...], ...]} (chat-formatted ids, made by run.py). For each
prompt: the package's own loader (DFlashDraftModel.from_pretrained) and generator
(dflash_generate, greedy, float32, on CPU) -> PREFIX.json with the new tokens and the
acceptance lengths it reports (tokens each verify produced, the first token from prefill aside).
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import time

import torch
from transformers import AutoModelForCausalLM

import dflash.model as dm
from dflash.model import DFlashDraftModel, dflash_generate


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--head", required=True)
    p.add_argument("--target", required=True)
    p.add_argument("--prompts", required=True)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    dm._cuda_time = time.perf_counter  # its stats timer syncs CUDA; nothing else in it needs a GPU
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32, attn_implementation="sdpa").eval()
    draft = DFlashDraftModel.from_pretrained(args.head, dtype=torch.float32).eval()
    out = {
        "versions": {n: md.version(n) for n in ("dflash", "torch", "transformers")},
        "block_size": draft.block_size,
        "mask_token_id": draft.mask_token_id,
        "target_layer_ids": list(draft.target_layer_ids),
        "new_tokens": [],
        "acceptance_lengths": [],
    }
    for ids in json.load(open(args.prompts))["prompt_token_ids"]:
        prompt = torch.tensor([ids])
        stats = dflash_generate(draft, target, prompt, args.max_tokens, None, temperature=0.0, return_stats=True)
        out["new_tokens"].append(stats.output_ids[0, prompt.shape[1] :].tolist())
        out["acceptance_lengths"].append(list(stats.acceptance_lengths))
    with open(f"{args.out}.json", "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps({k: v for k, v in out.items() if k != "new_tokens"}))


if __name__ == "__main__":
    main()
