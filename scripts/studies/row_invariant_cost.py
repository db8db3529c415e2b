"""The cost of row invariance: one verify forward through the fastest kernels and through the
row-invariant ones, by node count, timed in one process.

    .venv/bin/python scripts/studies/row_invariant_cost.py --target smollm2-135m --dtype bfloat16 \
        --threads 2 --context 300 --nodes 1,4,9,17,32 --repeats 15 --out out/row-invariant-cost.json

One verification round as the engine runs it (TorchTarget.verify over a chain of N nodes after
`--context` cached tokens, hidden states returned, then the cache cut back), for each setting:

    fastest            the linears dispatched by row count (inference/kernels/target_linears.py)
                       and transformers' attention: what `--no-row-invariant` runs
    invariant          the row-invariant kernels on the path this CPU runs for the dtype
                       (inference/kernels/invariant_linear.py `path_for`) and the row attention
    invariant:PATH     the same on another path this CPU has (`--paths all`: every one of them)

Settings are interleaved repeat by repeat, so drift on a shared machine hits all alike; the
median per (setting, N) is reported, and each invariant setting's ratio to `fastest`. The issue
that asked for the kernels (docs/acceptance.md "Row invariance") set the bar at 1.1x at 17 nodes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from drafthead import load_target
from drafthead.inference.engine.torch_target import TorchTarget
from drafthead.inference.engine.tree import DraftTree, chain_parents
from drafthead.inference.kernels import invariant_linear
from drafthead.inference.kernels.machine import cpu_model


@contextlib.contextmanager
def on_path(path: str | None):
    """DRAFTHEAD_INVARIANT_PATH=path within the block (None: the CPU's own choice)."""
    before = os.environ.get(invariant_linear.ENV_PATH)
    if path is not None:
        os.environ[invariant_linear.ENV_PATH] = path
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(invariant_linear.ENV_PATH, None)
        else:
            os.environ[invariant_linear.ENV_PATH] = before


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--context", type=int, default=300, help="cached tokens before the round")
    p.add_argument("--nodes", default="1,4,9,17,32")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--paths", default="", help="'all': time every row-invariant path this CPU has, besides its own choice")
    p.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="cpu: this process's CPU seconds instead of wall time, for a machine other work shares (with --threads 1)",
    )
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    model = load_target(args.target, dtype=args.dtype, threads=args.threads).model
    dtype = next(model.parameters()).dtype
    nodes = [int(n) for n in args.nodes.split(",")]
    chosen = invariant_linear.path_for(dtype)
    settings: dict[str, str | None] = {"fastest": None, "invariant": chosen}
    if args.paths == "all":
        settings.update(
            {f"invariant:{path}": path for path in invariant_linear.cpu_paths() if path != chosen and invariant_linear.takes(path, dtype)}
        )
    g = torch.Generator().manual_seed(0)
    vocab = model.get_input_embeddings().num_embeddings
    prompt = torch.randint(100, vocab, (args.context + 1,), generator=g)
    trees = {n: DraftTree(torch.randint(100, vocab, (1, n), generator=g), chain_parents(n - 1)) for n in nodes}
    backends = {name: TorchTarget(model, row_invariant=path is not None) for name, path in settings.items()}

    def round_once(name: str, n: int) -> float:
        backend = backends[name]
        with on_path(settings[name]), torch.inference_mode(), backend.engine_context(True):
            start = clock()
            backend.verify([trees[n]], [args.context], True)
            seconds = clock() - start
            backend.discard(args.context)
        return seconds

    for name, backend in backends.items():  # each its own prefill, then one untimed round per size
        with on_path(settings[name]), torch.inference_mode(), backend.engine_context(True):
            backend.start([prompt], (), False)
        for n in nodes:
            round_once(name, n)
    times: dict[str, dict[int, list[float]]] = {name: {n: [] for n in nodes} for name in settings}
    for _ in range(args.repeats):
        for n in nodes:
            for name in settings:
                times[name][n].append(round_once(name, n))
    ms = {name: {n: 1e3 * statistics.median(times[name][n]) for n in nodes} for name in settings}
    setup = f"{args.threads} threads, {args.dtype}, {args.context} cached tokens, {args.clock} clock"
    print(f"{cpu_model()}, torch {torch.__version__}, {setup}; this CPU's paths: {', '.join(invariant_linear.cpu_paths())}")
    print()
    print("| setting | " + " | ".join(f"N={n}" for n in nodes) + " |")
    print("| --- | " + " | ".join("---:" for _ in nodes) + " |")
    for name in settings:
        label = name if name != "invariant" else f"invariant ({chosen})"
        print(f"| {label} | " + " | ".join(f"{ms[name][n]:.1f}" for n in nodes) + " |")
    for name in settings:
        if name != "fastest":
            print(f"| {name} / fastest | " + " | ".join(f"{ms[name][n] / ms['fastest'][n]:.2f}x" for n in nodes) + " |")
    if args.out:
        report = {
            "cpu": cpu_model(),
            "torch": torch.__version__,
            "threads": args.threads,
            "dtype": args.dtype,
            "context": args.context,
            "clock": args.clock,
            "cpu_paths": list(invariant_linear.cpu_paths()),
            "settings": settings,
            "ms": {name: {str(n): v for n, v in per.items()} for name, per in ms.items()},
        }
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
