"""The GPU check's long-context step (scripts/gpu/check.sh): one training step (forward, backward,
AdamW) of an EAGLE-3 head on one row of T tokens, online features from a bf16 target of SmolLM2-135M's
shapes with random weights (the staged config; scripts/gpu/stage.py says why no weights), for
growing T. Reports the device's peak memory over what it held before the step, the seconds, and
`train --plan`'s estimate of the same step; prints one JSON line per length.

    python scripts/gpu/long_context.py --stage .gpu --lengths 8192 32768 131072 --chunk-mb 1024

--chunk-mb sets the training-time-test attention's chunk budget (heads/ttt_attention.py
CHUNK_BYTES): 64 MiB keeps a CPU's transient small; a GPU with memory to spare runs fewer, larger
chunks. A length whose step would start after --budget-s seconds of the sweep is skipped, and one
that runs out of memory is reported as such; the sweep goes on to its summary either way.
`--dry-run`: two short lengths on the CPU (tests/test_gpu_check.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def step(head, target, config, T: int, device: str) -> dict:
    import torch

    from drafthead.heads.batch import FeatureBatch
    from drafthead.train.capture.features import target_features

    optimizer = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=1e-4)
    g = torch.Generator().manual_seed(T)
    ids = torch.randint(3, config.vocab_size, (1, T), generator=g).to(device)
    mask = torch.ones(1, T, dtype=torch.long, device=device)
    cuda = device == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated() if cuda else 0
    start = time.perf_counter()
    hidden = target_features(target, ids, mask, config.train_hidden_layers)
    batch = FeatureBatch(ids, mask, torch.ones(1, T, dtype=torch.bool, device=device), hidden)
    loss, _ = head.compute_loss(batch)
    loss.backward()
    optimizer.step()
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() if cuda else 0
    del optimizer, hidden, batch
    head.zero_grad(set_to_none=True)
    return {
        "step_mb": round((peak - before) / 2**20, 1),
        "seconds": round(seconds, 2),
        "tokens_per_s": round(T / seconds, 1),
        "loss": round(float(loss.detach()), 5),
    }


def planned_mb(head, config, T: int) -> float:
    """`train --plan`'s activations plus the gradients and AdamW moments the step creates."""
    from drafthead.train.loop.plan import RunShapes, activation_bytes

    trainable = sum(p.numel() for p in head.parameters() if p.requires_grad)
    shapes = RunShapes(
        target_bytes=0,
        largest_layer_bytes=0,
        layers_bytes=0,
        head_trainable=trainable,
        head_frozen_bytes=0,
        hidden=config.hidden_size,
        draft_vocab=config.draft_vocab_size,
        steps=config.ttt_steps,
        kind="eagle3",
        tokens=T,
    )
    return round((activation_bytes(shapes) + 12 * trainable) / 2**20, 1)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stage", default=".gpu")
    p.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768, 65536, 131072])
    p.add_argument("--chunk-mb", type=float, default=1024.0)
    p.add_argument("--budget-s", type=float, default=150.0, help="start no length after this many seconds")
    p.add_argument("--out", default=None, help="also write the rows here as JSON lines")
    p.add_argument("--dry-run", action="store_true")
    args = p.parse_args(argv)
    if args.dry_run:
        args.lengths, args.chunk_mb = [64, 128], 0.05  # chunks of 11 and 5 query rows

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from drafthead.heads.registry import build_head, make_config
    from drafthead.heads import ttt_attention

    device = "cuda" if torch.cuda.is_available() and not args.dry_run else "cpu"
    ttt_attention.CHUNK_BYTES = int(args.chunk_mb * 2**20)
    target_config = AutoConfig.from_pretrained(Path(args.stage) / "smollm2")
    if args.dry_run:  # two layers of SmolLM2's widths: the CPU runs the same code in seconds
        target_config.num_hidden_layers = 2
    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_config(target_config, dtype=torch.bfloat16).to(device).requires_grad_(False)
    config = make_config("eagle3", target, None, name="smollm2-shapes")
    counts = torch.arange(config.vocab_size, 0, -1).float()
    head = build_head(config, target, token_counts=counts, dtype=torch.float32).to(device).train()
    rows, sweep = [], time.perf_counter()
    for T in args.lengths:
        row = {"kind": "eagle3", "tokens": T, "device": device, "chunk_mb": args.chunk_mb, "planned_step_mb": planned_mb(head, config, T)}
        if time.perf_counter() - sweep > args.budget_s:
            row["skipped"] = f"the sweep passed its {args.budget_s:.0f} s budget"
        else:
            try:
                row.update(step(head, target, config, T, device))
            except torch.OutOfMemoryError as e:
                row["out_of_memory"] = str(e).splitlines()[0]
                head.zero_grad(set_to_none=True)
                torch.cuda.empty_cache()
        print(json.dumps(row), flush=True)
        rows.append(row)
    if args.out:
        Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return 0 if any("seconds" in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
