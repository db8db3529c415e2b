"""Batched decoding on the llama.cpp backend against llama.cpp's own: `llama-server` with B parallel
slots (continuous batching), B requests in flight, against our engine decoding the same prompts B
rows at a time on the same GGUF and threads, plainly and with prompt lookup under the load policy.

    .venv/bin/python scripts/studies/batch_vs_llamacpp.py --batch-sizes 1,4,16 --dataset edits --limit 16 \
        --max-new-tokens 64 --dtype float32 --out out/batch-llamacpp

Tokens/s is every prompt's new tokens over the wall clock of the whole set, prefill included on
every side; the server's also include its HTTP round trips (a few ms a request, on 127.0.0.1).
Greedy; each side stops at the target's EOS tokens or at --max-new-tokens. "identical" is the
share of prompts whose output equals our batch-1 plain decoding. Writes OUT/batch.json and
OUT/batch.md. Needs `make llamacpp`.
"""

from __future__ import annotations

import argparse
import json
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def server_outputs(url: str, prompts: list[list[int]], n: int, concurrency: int) -> tuple[list[list[int]], float]:
    """Every prompt through llama-server's /completion, `concurrency` requests in flight; the new
    token ids of each and the wall seconds of the whole set."""

    def one(ids: list[int]) -> list[int]:
        body = json.dumps(
            {"prompt": ids, "n_predict": n, "temperature": 0.0, "top_k": 1, "cache_prompt": False, "return_tokens": True, "seed": 0}
        ).encode()
        request = urllib.request.Request(f"{url}/completion", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=600) as response:
            return json.loads(response.read())["tokens"]

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        outputs = list(pool.map(one, prompts))
    return outputs, time.perf_counter() - start


def ours(backend, make_drafter, prompts, n: int, batch: int, eos, sizing: str = "fixed") -> tuple[list[list[int]], float]:
    """Our engine over the prompts, `batch` rows at a time; new token ids and wall seconds."""
    import torch

    from drafthead.inference.engine.generate import GenerationConfig, generate_batch

    config = GenerationConfig(max_new_tokens=n, eos_token_ids=eos, sizing=sizing)
    outputs, start = [], time.perf_counter()
    for i in range(0, len(prompts), batch):
        result = generate_batch(backend, make_drafter(), [torch.tensor(p) for p in prompts[i : i + batch]], config)
        outputs += [row.new_tokens[0].tolist() for row in result.rows]
    return outputs, time.perf_counter() - start


def until_eos(tokens: list[int], eos) -> list[int]:
    """A server's tokens cut after the first EOS (it may stop there or print it; ours keeps it)."""
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1]
    return tokens


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", default="1,4,16")
    parser.add_argument("--dataset", default="edits", help="edits or mt-bench")
    parser.add_argument("--limit", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="out/batch-llamacpp")
    args = parser.parse_args()

    from drafthead.draft_spec import build_drafter
    from drafthead.inference.bench.prompts import encode_chat, load_prompts
    from drafthead.inference.engine.drafter import RootOnlyDrafter
    from drafthead.inference.engine.sizing import forget_sizing
    from drafthead.ground.target.identity import eos_token_ids
    from drafthead.ground.target.load import load_target, target_folder
    from drafthead.inference.llamacpp.convert import target_gguf
    from drafthead.inference.llamacpp.target import LlamaCppTarget
    from drafthead.inference.llamacpp.tools import llama_server
    from drafthead.inference.bench.edit_prompts import EDITS, edit_prompts
    from drafthead.train.data.sources import sharegpt_chats

    loaded = load_target("smollm2-135m", dtype=args.dtype, threads=args.threads)
    folder, _ = target_folder("smollm2-135m")
    gguf = target_gguf(folder, "f32" if args.dtype == "float32" else "bf16")
    backend = LlamaCppTarget(gguf, loaded.model.config, threads=args.threads)
    eos = tuple(eos_token_ids(loaded.model, loaded.tokenizer))
    chosen = edit_prompts(sharegpt_chats(), args.limit) if args.dataset == EDITS else load_prompts(args.dataset, args.limit)
    prompts = [encode_chat(loaded.tokenizer, p)[0].tolist() for p in chosen]
    n = args.max_new_tokens
    reference, _ = ours(backend, RootOnlyDrafter, prompts, n, 1, eos)
    rows = []
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        context = batch * (max(len(p) for p in prompts) + n + 64)
        with llama_server(gguf, threads=args.threads, context=context, slots=batch) as url:
            server_outputs(url, prompts[:1], 4, 1)  # warm-up
            served, served_s = server_outputs(url, prompts, n, batch)
        served = [until_eos(s, eos) for s in served]
        plain, plain_s = ours(backend, RootOnlyDrafter, prompts, n, batch, eos)
        lookup = lambda: build_drafter("prompt-lookup", loaded.model, loaded.tokenizer)  # noqa: E731
        forget_sizing(backend)  # each batch size's policy starts cold
        spec, spec_s = ours(backend, lookup, prompts, n, batch, eos, "policy")
        for name, outputs, seconds in (
            ("llama-server", served, served_s),
            ("ours plain", plain, plain_s),
            ("ours prompt lookup + policy", spec, spec_s),
        ):
            tokens = sum(len(o) for o in outputs)
            rows.append(
                {
                    "batch": batch,
                    "engine": name,
                    "tokens": tokens,
                    "seconds": round(seconds, 2),
                    "tokens_per_s": round(tokens / seconds, 1),
                    "identical": sum(o == r for o, r in zip(outputs, reference)) / len(prompts),
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "batch.json").write_text(json.dumps({"settings": vars(args), "rows": rows}, indent=1) + "\n")
    lines = ["| batch | engine | tokens/s | vs llama-server | identical to our batch-1 plain |", "| ---: | --- | ---: | ---: | ---: |"]
    for row in rows:
        base = next(r for r in rows if r["batch"] == row["batch"] and r["engine"] == "llama-server")
        lines.append(
            f"| {row['batch']} | {row['engine']} | {row['tokens_per_s']} | {row['tokens_per_s'] / base['tokens_per_s']:.2f}x | "
            f"{row['identical']:.0%} |"
        )
    (out / "batch.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
