"""The CPU kernels our engine picks from for a linear layer, timed by row count on the machine at hand.

    .venv/bin/python scripts/studies/bench_linears.py --rows 1,4,16,32 --threads 2

For each SmolLM2-135M shape (576 -> 1536, 1536 -> 576, 576 -> 576 and the LM head 576 -> 49152):
F.linear (MKL in fp32), the oneDNN-packed weight (inference/kernels/packed.py), and our panel kernel
(inference/kernels/panel_kernel.py) with fp32 panels and with bf16 panels (a weight whose values are all
bf16). Each kernel runs over `--layers` distinct weights in turn (one for the LM head), so the
weights stream from memory as in a forward rather than sitting in cache; best of `--repeats`
passes, in microseconds per call, kernels interleaved. Prints a Markdown table
(docs/cpu-measurements.md "Panel linears").
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn

from drafthead.inference.kernels import panel_kernel
from drafthead.inference.kernels.machine import cpu_model
from drafthead.inference.kernels.packed import pack_linear

SHAPES = ((576, 1536), (1536, 576), (576, 576), (576, 49152))  # (in, out)


def kernels_for(weights: list[torch.Tensor]) -> dict[str, list]:
    """{kernel name: one callable x -> y per weight}; a kernel the machine lacks is left out."""
    linears = []
    for w in weights:
        layer = nn.Linear(w.shape[1], w.shape[0], bias=False)
        layer.weight.data = w
        linears.append(layer)
    found = {"F.linear": [lambda x, w=w: F.linear(x, w) for w in weights]}
    packed = [pack_linear(layer, rows_hint=16) for layer in linears]
    if all(p is not None for p in packed):
        found["oneDNN packed"] = packed
    if panel_kernel.enabled():
        found["panels fp32"] = [panel_kernel.PanelLinear(layer) for layer in linears]
        rounded = []
        for layer in linears:
            copy = nn.Linear(layer.in_features, layer.out_features, bias=False)
            copy.weight.data = layer.weight.data.to(torch.bfloat16).float()  # bf16 values: bf16 panels
            rounded.append(panel_kernel.PanelLinear(copy))
        found["panels bf16"] = rounded
    return found


def best_us(calls: list, x: torch.Tensor, repeats: int) -> float:
    best = float("inf")
    for attempt in range(repeats + 1):  # the first pass warms up
        start = time.perf_counter()
        for call in calls:
            call(x)
        if attempt:
            best = min(best, (time.perf_counter() - start) / len(calls))
    return 1e6 * best


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", default="1,4,16,32")
    p.add_argument("--layers", type=int, default=30, help="distinct weights per shape (the LM head: one)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    g = torch.Generator().manual_seed(0)
    print(f"{cpu_model()}, {args.threads} threads; us per call (best of {args.repeats} passes over the weights)\n")
    names = None
    lines = []
    with torch.inference_mode():
        for n_in, n_out in SHAPES:
            count = 1 if n_out > 10_000 else args.layers
            kernels = kernels_for([torch.randn(n_out, n_in, generator=g) for _ in range(count)])
            if names is None:
                names = list(kernels)
                lines += ["| shape | rows | " + " | ".join(names) + " |", "| --- | ---: |" + " ---: |" * len(names)]
            for m in rows:
                x = torch.randn(m, n_in, generator=g)
                cells = " | ".join(f"{best_us(kernels[name], x, args.repeats):.0f}" if name in kernels else "-" for name in names)
                lines.append(f"| {n_in} -> {n_out} | {m} | {cells} |")
                print(lines[-1] if len(lines) > 3 else "\n".join(lines), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
