#!/usr/bin/env python
"""What verifying a chain costs on a hybrid target, against an attention-only one of the same size.

Two random targets with SmolLM2-135M's sizes (hidden 576, 30 layers, 9 heads of 64, vocabulary
49152): a Llama, and a Qwen3.5-style hybrid (three Gated DeltaNet layers to one full-attention
layer, linear heads of 64). For each, the verify forward of N chain nodes after `--context` cached
tokens, through the backend the decode loop drives (HybridTarget records the recurrent states the
chain passes through; inference/engine/hybrid_target.py), in multiples of one plain step (N = 1).
Speculation pays where a verify of N nodes costs much less than N plain steps.

    .venv/bin/python scripts/studies/hybrid_verify_cost.py --threads 2 --context 256
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SIZES = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=8192,
    bos_token_id=0,
    eos_token_id=1,
    pad_token_id=2,
)


def targets():
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3_5ForCausalLM, Qwen3_5TextConfig

    llama = LlamaConfig(**SIZES)
    hybrid = Qwen3_5TextConfig(
        **SIZES,
        head_dim=64,
        linear_num_value_heads=8,
        linear_num_key_heads=4,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_conv_kernel_dim=4,
        layer_types=["full_attention" if i % 4 == 3 else "linear_attention" for i in range(SIZES["num_hidden_layers"])],
    )
    out = {}
    for name, cls, config in (("llama", LlamaForCausalLM, llama), ("qwen3_5 hybrid", Qwen3_5ForCausalLM, hybrid)):
        config._attn_implementation = "sdpa"
        torch.manual_seed(0)
        out[name] = cls(config).eval().requires_grad_(False)
    return out


def main() -> int:
    from drafthead.inference.engine.cost import measure_verify_cost

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--nodes", default="1,2,4,8,16")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", help="a JSON file for the table")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    nodes = [int(n) for n in args.nodes.split(",")]
    rows = {}
    for name, model in targets().items():
        curve = measure_verify_cost(model, nodes, context=args.context, repeats=args.repeats, want_hidden=False)
        ms = [1000 * s for s in curve.seconds]
        rows[name] = {"ms": ms, "plain_steps": [m / ms[0] for m in ms]}
    print(f"| target | {' | '.join(f'N={n}' for n in nodes)} |")
    print(f"| --- | {' | '.join('---:' for _ in nodes)} |")
    for name, r in rows.items():
        cells = [f"{m:.1f} ms ({x:.2f})" for m, x in zip(r["ms"], r["plain_steps"])]
        print(f"| {name} | {' | '.join(cells)} |")
    if args.out:
        Path(args.out).write_text(json.dumps({"context": args.context, "threads": args.threads, "nodes": nodes, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
