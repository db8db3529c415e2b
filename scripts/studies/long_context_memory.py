"""Peak memory and tokens/s of one training step at long context (docs/scaling.md "Long
conversations"): SmolLM2-135M as the frozen target (online features), one row of T tokens, an
EAGLE-3 or DFlash head, forward + backward + AdamW step, each length in a fresh process (peak RSS
is a process-lifetime high-water mark), against `train --plan`'s activation estimate.

    .venv/bin/python scripts/studies/long_context_memory.py --kind eagle3 --lengths 2048 8192
    .venv/bin/python scripts/studies/long_context_memory.py --kind eagle3 --lengths 8192 --context-parallel 2

With --context-parallel N, N processes (gloo) take the same row, each its 1/N of the columns
(heads/context_split.py), with --threads split between them; each reports its own peak. The
target's forward is split as well (train/capture/split_target.py). EAGLE-3 only.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time


def one(kind: str, T: int, threads: int, rank: int = 0, size: int = 1, port: int = 0) -> dict:
    import torch

    from drafthead.heads.registry import build_head, make_config
    from drafthead.heads.batch import FeatureBatch
    from drafthead.ground.target.load import load_target
    from drafthead.train.capture.features import target_features
    from drafthead.train.capture.split_target import split_target_features
    from drafthead.train.loop.allocator import map_large_blocks_for
    from drafthead.train.loop.plan import RunShapes, activation_bytes

    map_large_blocks_for(T)  # as `drafthead train` does (train/loop/allocator.py)
    torch.set_num_threads(threads)
    loaded = load_target("smollm2-135m", dtype="bfloat16", threads=threads)
    target = loaded.model.requires_grad_(False)
    extra = {"mask_token_id": 2} if kind in ("dflash", "peagle") else {}
    config = make_config(kind, target, loaded.tokenizer, name="smollm2-135m", **extra)
    counts = torch.arange(config.vocab_size, 0, -1).float()  # any ranking: the draft vocab's size is what counts here
    torch.manual_seed(0)  # every rank of a split row builds the same head
    head = build_head(config, target, token_counts=counts, dtype=torch.float32).train()
    params = [p for p in head.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, config.vocab_size, (1, T), generator=g)
    mask = torch.ones(1, T, dtype=torch.long)
    split = None
    if size > 1:
        import os

        import torch.distributed as dist

        from drafthead.heads.context_split import ContextSplit

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=size)
        split = head.context_split = ContextSplit(rank, size)
    before = rss_mb()
    start = time.perf_counter()
    if split is None:
        hidden = target_features(target, ids, mask, config.train_hidden_layers)
    else:  # the target's forward split too (train/capture/split_target.py), as `drafthead train` runs it
        hidden = split_target_features(target, ids, mask, config.train_hidden_layers, split, final=config.final_layer, halo=config.ttt_steps)
    batch = FeatureBatch(ids, mask, torch.ones(1, T, dtype=torch.bool), hidden, split_columns=split is not None)
    loss, _ = head.compute_loss(batch)
    loss.backward()
    optimizer.step()
    seconds = time.perf_counter() - start
    peak = rss_mb()
    if size > 1:
        dist.all_reduce(loss.detach())  # the row's loss, as one process computes it
        dist.destroy_process_group()
    # `train --plan`'s model of the same step: activations, plus the gradients and AdamW's two
    # moments that appear during it (the parameters were there before)
    shapes = RunShapes(
        target_bytes=0,
        largest_layer_bytes=0,
        layers_bytes=0,
        head_trainable=sum(p.numel() for p in params),
        head_frozen_bytes=0,
        hidden=config.hidden_size,
        draft_vocab=getattr(config, "draft_vocab_size", config.vocab_size),
        steps=getattr(config, "ttt_steps", 1),
        kind=kind,
        tokens=T,
    )
    planned = (activation_bytes(shapes) + 12 * shapes.head_trainable) / 2**20
    return {
        "kind": kind,
        "tokens": T,
        "rank": rank,
        "context_parallel": size,
        "peak_rss_mb": peak,
        "rss_before_step_mb": before,
        "step_mb": peak - before,
        "planned_step_mb": planned,
        "planned_over_measured": planned / (peak - before) if peak > before else None,
        "seconds": seconds,
        "tokens_per_s": T / seconds,
        "loss": float(loss),
    }


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kind", default="eagle3")
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192, 16384, 32768])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context-parallel", type=int, default=1, help="processes one row is split across")
    parser.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # a child's length
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one is not None:
        print(json.dumps(one(args.kind, args.one, args.threads, args.rank, args.context_parallel, args.port)))
        return
    from drafthead.inference.servers.local import free_port

    size = args.context_parallel
    threads = max(1, args.threads // size)
    for T in args.lengths:
        port = free_port()
        children = [
            subprocess.Popen(
                [
                    sys.executable,
                    __file__,
                    "--kind",
                    args.kind,
                    "--threads",
                    str(threads),
                    "--one",
                    str(T),
                    "--rank",
                    str(r),
                    "--context-parallel",
                    str(size),
                    "--port",
                    str(port),
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for r in range(size)
        ]
        for child in children:
            out, err = child.communicate()
            line = out.strip().splitlines()[-1] if child.returncode == 0 and out.strip() else None
            print(
                line or json.dumps({"kind": args.kind, "tokens": T, "failed": child.returncode, "stderr": err.strip().splitlines()[-1:]}), flush=True
            )


if __name__ == "__main__":
    main()
