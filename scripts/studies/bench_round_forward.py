"""The target's round forward by engine setting and node count, timed in one process.

    .venv/bin/python scripts/studies/bench_round_forward.py --target smollm2-135m --dtype float32 \
        --context 256 --nodes 1,8,17,32 --repeats 15 --out out/round-forward.json

One verification round as the engine runs it (forward_trees over a chain of N nodes after
`--context` cached tokens, all hidden states returned, then the cache cut back), for each setting:

    dynamic            transformers DynamicCache, eager, target linears dispatched by row count
    dynamic-F.linear   the same with the target's own nn.Linear everywhere
    static             our static cache, eager
    compiled           static cache + torch.compile (inductor, dynamic shapes), linears dispatched
    compiled-F.linear  the same with nn.Linear (inductor's own matmuls)
    frozen             static cache + inductor with frozen weights (constants folded into the
                       graph, weights pre-packed for oneDNN) and the C++ wrapper (no Python
                       between kernels), linears dispatched
    frozen-F.linear    the same with nn.Linear: inductor packs and calls the matmuls itself

`DRAFTHEAD_PANEL_KERNEL=0` in the environment leaves our panel kernel out of the dispatched
linears (inference/kernels/panel_kernel.py), to time the engine without it.

Settings are interleaved repeat by repeat, so drift on a shared machine hits all alike; the
median per (setting, N) is reported, with the compile seconds of the first calls. Prints a
Markdown table (ms per round, and tokens/s of a plain round for N = 1).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from drafthead import load_target
from drafthead.inference.engine.cache import cache_kwargs, crop, new_cache
from drafthead.inference.engine.compiled import StaticDecoding
from drafthead.inference.kernels.target_linears import engine_linears
from drafthead.inference.engine.tree import DraftTree, chain_parents, pad_trees
from drafthead.inference.engine.verify import forward_trees

SETTINGS = {  # name: (static cache, torch.compile backend, dispatched linears)
    "dynamic": (False, None, True),
    "dynamic-F.linear": (False, None, False),
    "static": (True, None, True),
    "compiled": (True, "inductor", True),
    "compiled-F.linear": (True, "inductor", False),
    "frozen": (True, "inductor-frozen", True),
    "frozen-F.linear": (True, "inductor-frozen", False),
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--dtype", default="float32")
    p.add_argument(
        "--round-weights",
        default=None,
        choices=("bfloat16",),
        help="the target's weights rounded to bf16 values (ground/target/load.py round_to_bfloat16)",
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--context", type=int, default=256, help="cached tokens before the round")
    p.add_argument("--nodes", default="1,8,17,32")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--settings", default=",".join(SETTINGS))
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    model = load_target(args.target, dtype=args.dtype, threads=args.threads, round_weights=args.round_weights).model
    nodes = [int(n) for n in args.nodes.split(",")]
    names = args.settings.split(",")
    g = torch.Generator().manual_seed(0)
    context = torch.randint(100, 5000, (1, args.context), generator=g)
    trees = {n: pad_trees([DraftTree(torch.randint(100, 5000, (1, n), generator=g), chain_parents(n - 1))]) for n in nodes}
    lengths = torch.tensor([args.context])
    states = {}
    for name in names:
        static, backend, linears = SETTINGS[name]
        decoding = StaticDecoding.of(model, backend) if static else None
        # the two compiled settings share one cache (StaticDecoding keeps one per shape): harmless,
        # both hold the same context and every round cuts the cache back to it
        cache = decoding.cache(1, args.context + 512) if static else new_cache()
        with torch.inference_mode(), engine_linears(model, linears):
            model(input_ids=context, **cache_kwargs(model, cache), use_cache=True)
        states[name] = (cache, None if decoding is None else decoding.forward, linears)

    def one_round(name: str, n: int) -> float:
        cache, forward, linears = states[name]
        with torch.inference_mode(), engine_linears(model, linears):
            start = time.perf_counter()
            forward_trees(model, cache, trees[n], lengths, args.context, want_hidden=True, forward=forward)
            crop(cache, args.context)
            return time.perf_counter() - start

    first = {}
    for name in names:  # warm-up: the compiled settings compile here
        for n in nodes:
            first[(name, n)] = one_round(name, n)
            one_round(name, n)
    times = {(name, n): [] for name in names for n in nodes}
    for _ in range(args.repeats):
        for n in nodes:
            for name in names:
                times[(name, n)].append(one_round(name, n))
    ms = {key: 1000 * statistics.median(v) for key, v in times.items()}
    lines = [
        "| setting | " + " | ".join(f"N={n} ms" for n in nodes) + " | first calls s |",
        "| --- | " + " | ".join("---:" for _ in nodes) + " | ---: |",
    ]
    for name in names:
        cells = " | ".join(f"{ms[(name, n)]:.1f}" for n in nodes)
        lines.append(f"| {name} | {cells} | {sum(first[(name, n)] for n in nodes):.1f} |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(
            json.dumps(
                {
                    "settings": vars(args),
                    "median_ms": {f"{k[0]}@{k[1]}": v for k, v in ms.items()},
                    "first_call_s": {f"{k[0]}@{k[1]}": v for k, v in first.items()},
                    "table": table,
                },
                indent=1,
            )
            + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
