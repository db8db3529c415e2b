"""Servers under load: `drafthead serve` against `llama-server` on the same GGUF and threads, with
1, 4 and 16 requests in flight, plainly and with n-gram / prompt-lookup drafting; or (--check-alone)
one of ours, its answers at 16 in flight against the same requests sent one at a time.

    # make serve-load: ours on SmolLM2 (torch), 64 requests, 16 in flight, each equal to alone
    .venv/bin/python scripts/studies/serve_load.py --engines ours-lookup --backend torch --limit 64 \\
        --concurrency 16 --check-alone --out out/serve-load
    # the table against llama-server (needs `make llamacpp`)
    .venv/bin/python scripts/studies/serve_load.py --dataset edits --limit 16 --max-tokens 128 \\
        --concurrency 1,4,16 --out out/serve-edits

Every request is a completion of the prompt's chat-rendered token ids (so every server reads the
same tokens), greedy, stopping at the target's EOS or --max-tokens. tokens/s is every answer's
tokens over the wall clock of the whole set, prefill and HTTP included; latency is each
request's, send to last byte. "identical" is the share of answers equal to ours plain at 1 in
flight (EOS cut off). Each server is started for each concurrency, warmed up with one request,
and stopped after. Writes OUT/serve.json, OUT/serve.md and OUT/serve.png.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

# name -> (what serves, drafthead serve's drafting options or llama-server's flags)
ENGINES = {
    "ours-plain": ("ours", ["--proposer", "none"]),
    "ours-lookup": ("ours", ["--proposer", "prompt-lookup", "--sizing", "policy"]),
    "ours-head": ("ours", ["--proposer", "head", "--sizing", "policy"]),
    "ours-plain-unified": ("ours", ["--proposer", "none", "--kv-layout", "unified"]),
    "ours-lookup-unified": ("ours", ["--proposer", "prompt-lookup", "--sizing", "policy", "--kv-layout", "unified"]),
    "llama-server": ("llama", []),
    "llama-server-ngram": ("llama", ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3"]),
}
ROW_CELLS = 4096  # cells per request each server gets


def post(url: str, path: str, body: dict) -> dict:
    request = urllib.request.Request(url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=3600) as response:
        return json.loads(response.read())


def ask(kind: str, url: str, prompt: list[int], n: int) -> list[int]:
    """One greedy completion of `prompt` (token ids) -> the answer's token ids."""
    if kind == "ours":
        reply = post(url, "/v1/completions", {"model": "smollm2-135m", "prompt": prompt, "max_tokens": n, "temperature": 0, "return_token_ids": True})
        return reply["choices"][0]["token_ids"]
    reply = post(url, "/completion", {"prompt": prompt, "n_predict": n, "temperature": 0, "top_k": 1, "cache_prompt": False, "return_tokens": True})
    return reply["tokens"]


def run_set(kind: str, url: str, prompts: list[list[int]], n: int, concurrency: int) -> tuple[list[list[int]], list[float], float]:
    """Every prompt, `concurrency` in flight: (answers, latencies, wall seconds)."""

    def one(prompt):
        start = time.perf_counter()
        ids = ask(kind, url, prompt, n)
        return ids, time.perf_counter() - start

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(one, prompts))
    return [ids for ids, _ in results], [s for _, s in results], time.perf_counter() - start


@contextmanager
def started(name: str, args, slots: int, gguf: Path | None, log: Path):
    from drafthead.inference.servers.local import local_server

    kind, flags = ENGINES[name]
    if kind == "llama":
        from drafthead.inference.llamacpp.tools import tool

        common = ["-t", args.threads, "-tb", args.threads, "-c", slots * ROW_CELLS, "-np", slots, "--no-webui", "--seed", "0"]

        def command(port):
            return [tool("llama-server"), "-m", gguf, "--host", "127.0.0.1", "--port", port, *common, *flags]

    else:
        backend = ["--backend", args.backend, "--dtype", args.dtype, "--threads", args.threads, "--max-batch", slots]
        if args.backend == "llama.cpp":
            backend += ["--kv-cells", slots * (ROW_CELLS + 256)]

        def command(port):
            return [sys.executable, "-m", "drafthead", "serve", "--port", port, *backend, *flags]

    with local_server(command, name, log=log, ready_within=900) as url:
        yield kind, url


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def until_eos(tokens: list[int], eos) -> list[int]:
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[:i]
    return tokens


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", default="ours-plain,ours-lookup,llama-server,llama-server-ngram", help=f"of {', '.join(ENGINES)}")
    parser.add_argument("--dataset", default="mt-bench", help="mt-bench, edits or a .jsonl file")
    parser.add_argument("--limit", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--concurrency", default="1,4,16")
    parser.add_argument("--backend", default="llama.cpp", choices=("llama.cpp", "torch"))
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--check-alone", action="store_true", help="ours only: every answer equals the same request sent alone")
    parser.add_argument("--out", default="out/serve-load")
    args = parser.parse_args()

    from drafthead.inference.bench.prompts import encode_chat, load_prompts
    from drafthead.ground.target.identity import eos_token_ids
    from drafthead.ground.target.load import load_target, target_folder
    from drafthead.inference.bench.edit_prompts import EDITS, edit_prompts
    from drafthead.train.data.sources import sharegpt_chats

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    loaded = load_target("smollm2-135m", dtype="float32")
    eos = tuple(eos_token_ids(loaded.model, loaded.tokenizer))
    chosen = edit_prompts(sharegpt_chats(), args.limit) if args.dataset == EDITS else load_prompts(args.dataset, args.limit)
    prompts = [encode_chat(loaded.tokenizer, p)[0].tolist() for p in chosen]
    del loaded
    gguf = None
    engines = args.engines.split(",")
    if any(ENGINES[e][0] == "llama" for e in engines):
        from drafthead.inference.llamacpp.convert import target_gguf

        gguf = target_gguf(target_folder("smollm2-135m")[0], "f32" if args.dtype == "float32" else "bf16")
    levels = [int(c) for c in args.concurrency.split(",")]
    rows, reference = [], None
    for name in engines:
        for concurrency in levels:
            with started(name, args, concurrency, gguf, out / f"{name}-{concurrency}.log") as (kind, url):
                ask(kind, url, prompts[0], 4)  # warm-up
                alone = run_set(kind, url, prompts, args.max_tokens, 1)[0] if args.check_alone else None
                answers, latencies, seconds = run_set(kind, url, prompts, args.max_tokens, concurrency)
            answers = [until_eos(a, eos) for a in answers]
            if reference is None:
                reference = answers  # the first engine at its first concurrency
            tokens = sum(len(a) for a in answers)
            row = {
                "engine": name,
                "in_flight": concurrency,
                "requests": len(answers),
                "tokens": tokens,
                "seconds": round(seconds, 2),
                "tokens_per_s": round(tokens / seconds, 1),
                "p50_s": round(percentile(latencies, 0.5), 2),
                "p99_s": round(percentile(latencies, 0.99), 2),
                "identical": round(sum(a == r for a, r in zip(answers, reference)) / len(answers), 3),
            }
            if alone is not None:
                row["equal_to_alone"] = sum(a == until_eos(b, eos) for a, b in zip(answers, alone))
            row["differ_at"] = [next((k for k, (x, y) in enumerate(zip(a, r)) if x != y), None) for a, r in zip(answers, reference) if a != r]
            rows.append(row)
            (out / f"answers-{name}-{concurrency}.json").write_text(json.dumps({"prompts": prompts, "answers": answers}))
            print(json.dumps(row), flush=True)
    (out / "serve.json").write_text(json.dumps({"settings": vars(args), "rows": rows}, indent=1) + "\n")
    base = {r["in_flight"]: r for r in rows if r["engine"] == "llama-server"}
    lines = [
        "| engine | in flight | tokens/s | vs llama-server | p50 latency s | p99 latency s | identical |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        versus = f"{r['tokens_per_s'] / base[r['in_flight']]['tokens_per_s']:.2f}x" if r["in_flight"] in base else "-"
        lines.append(
            f"| {r['engine']} | {r['in_flight']} | {r['tokens_per_s']} | {versus} | {r['p50_s']} | {r['p99_s']} | {r['identical']:.0%} |"
            + (f" equal to alone: {r['equal_to_alone']}/{r['requests']}" if "equal_to_alone" in r else "")
        )
    (out / "serve.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(rows, out / "serve.png")
    return 0


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name in dict.fromkeys(r["engine"] for r in rows):
        mine = [r for r in rows if r["engine"] == name]
        ax.plot([r["in_flight"] for r in mine], [r["tokens_per_s"] for r in mine], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("requests in flight")
    ax.set_ylabel("tokens/s (all requests)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
