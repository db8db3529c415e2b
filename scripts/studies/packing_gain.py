"""What packing (`data.packing`, train/capture/packing.py) gains on ShareGPT's real length distribution.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/studies/packing_gain.py --limit 400 --batches 4 --threads 1
    OMP_NUM_THREADS=1 .venv/bin/python scripts/studies/packing_gain.py --limit 400 --batches 0 --max-length 2048

Two parts. The layout: over every formatted ShareGPT conversation of `--limit`, shuffled as a
training epoch is, the share of token slots that hold a real token when each micro-batch of
`--batch-size` is padded one conversation per row, and when it is packed into rows of
`data.max_length`, for several batch sizes. The speed: `--batches` micro-batches of the preset
(online SmolLM2 features, fp32), each run one per row and packed, in alternating order, timing the
target's forward, the head's loss and its backward; tokens/s counts real tokens only. The two
layouts train on the same conversations, so their losses agree (printed beside the times).
"""

from __future__ import annotations

import argparse
import platform
import time


def slot_shares(lengths: list[int], batch_size: int, capacity: int) -> tuple[float, float]:
    """(padded, packed): real tokens / token slots over consecutive micro-batches of `lengths`."""
    from drafthead.train.capture.packing import pack_rows

    real = padded = packed = 0
    for start in range(0, len(lengths) - batch_size + 1, batch_size):
        chunk = lengths[start : start + batch_size]
        real += sum(chunk)
        padded += len(chunk) * max(chunk)
        rows = pack_rows(chunk, capacity)
        packed += len(rows) * max(sum(chunk[i] for i in row) for row in rows)
    return real / padded, real / packed


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="eagle3", help="the preset whose head is trained")
    p.add_argument("--limit", type=int, default=400, help="ShareGPT conversations read")
    p.add_argument("--max-length", type=int, default=None, help="data.max_length (default: the preset's)")
    p.add_argument("--batch-size", type=int, default=4, help="conversations per micro-batch in the timed part")
    p.add_argument("--batches", type=int, default=8, help="micro-batches timed in each layout (0: the layout table only)")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)

    import torch

    from drafthead.ground.target.load import load_target
    from drafthead.train.loop.config import load_config
    from drafthead.train.capture.features import OnlineFeaturizer, collate, required_layers
    from drafthead.train.capture.packing import collate_packed
    from drafthead.train.loop.run import head_config_for, new_or_saved_head, token_samples
    from drafthead.train.loop.trainer import epoch_batches

    overrides = [f"data.limit={args.limit}", "features.mode=online"]
    if args.max_length:
        overrides.append(f"data.max_length={args.max_length}")
    cfg = load_config(args.config, overrides)
    capacity = cfg.data.max_length
    loaded = load_target("smollm2-135m", dtype="float32", threads=args.threads)
    samples = token_samples(cfg, loaded.tokenizer).dataset
    order = epoch_batches(len(samples), 1, 1, 0, cfg.seed, 0)  # one epoch's shuffle
    lengths = [len(samples[i]["input_ids"]) for (i,) in order]
    print(
        f"{cpu_model()}, {args.threads} thread(s); {len(lengths)} ShareGPT conversations cut to {capacity} tokens: "
        f"mean {sum(lengths) / len(lengths):.0f}, {sum(n == capacity for n in lengths)} at the cut"
    )
    print("\n| conversations per micro-batch | real tokens / slots, one per row | packed | slots saved |")
    print("| ---: | ---: | ---: | ---: |")
    for b in (2, 4, 8, 16):
        padded, packed = slot_shares(lengths, b, capacity)
        print(f"| {b} | {padded:.2f} | {packed:.2f} | {1 - padded / packed:.0%} |")

    if not args.batches:
        return 0
    hcfg = head_config_for(cfg, loaded.model, loaded.tokenizer, loaded.name)
    featurize = OnlineFeaturizer(loaded.model, required_layers(hcfg, hcfg.final_layer))
    head = new_or_saved_head(
        cfg, hcfg, loaded.model, loaded.tokenizer, loaded.name, lambda m: None, lambda: samples.token_counts(hcfg.vocab_size)
    ).train()
    layouts = {"one per row": lambda s: collate(s), "packed": lambda s: collate_packed(s, capacity)}
    seconds = dict.fromkeys(layouts, 0.0)
    tokens, losses = 0, {name: [] for name in layouts}
    batches = epoch_batches(len(samples), args.batch_size, 1, 0, cfg.seed, 0)[: args.batches + 1]
    for k, indices in enumerate(batches):
        chunk = [samples[i] for i in indices]
        names = list(layouts) if k % 2 == 0 else list(reversed(layouts))
        for name in names:
            torch.manual_seed(k)  # the same TTT ramp / anchors draw in both layouts
            start = time.perf_counter()
            batch = featurize(layouts[name](chunk))
            loss, _ = head.compute_loss(batch)
            loss.backward()
            head.zero_grad(set_to_none=True)
            if k:  # the first micro-batch warms up
                seconds[name] += time.perf_counter() - start
                losses[name].append(loss.item())
        if k:
            tokens += sum(len(s["input_ids"]) for s in chunk)
    print(f"\n{args.batches} micro-batches of {args.batch_size} conversations ({tokens} real tokens), {args.config} head, online features, fp32:")
    print("| layout | s | tokens/s | mean loss |")
    print("| --- | ---: | ---: | ---: |")
    for name in layouts:
        print(f"| {name} | {seconds[name]:.1f} | {tokens / seconds[name]:.0f} | {sum(losses[name]) / len(losses[name]):.4f} |")
    print(f"gain: {seconds['one per row'] / seconds['packed']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
