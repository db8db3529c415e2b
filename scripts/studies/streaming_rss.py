"""Peak memory of the streaming data path (train/data/streaming.py) on a chat file much larger than it.

Writes a synthetic OpenAI-form JSONL file of about --gb gigabytes (a few hundred distinct records
whose words are drawn at random, repeated under fresh ids), then measures, each in a fresh process
so that every peak RSS (`ru_maxrss`) is its own:

  baseline: the imports and the SmolLM2 tokenizer alone (what every other line includes)
  read:     one full pass over the whole file through the streaming reader (decode + normalise)
  stream:   the first --samples training samples through `TokenStream.batches` with the SmolLM2
            tokenizer (shuffle buffer of 1000, 64 eval samples held out): what a training run holds
  load:     the non-streaming `load_conversations` of the whole file into a cold cache (normalised
            rows written as Arrow in batches; the result is memory-mapped, not read)
and on a --small-mb file of the same records, for comparison:
  cached:   the non-streaming path, `load_conversations` + `tokenize_conversations`
  list:     `read_conversations`, every normalised row as Python objects (what the non-streaming
            path held before it wrote through `datasets`)

    python scripts/studies/streaming_rss.py --gb 1.5 --samples 3000 --small-mb 40

The file goes to --dir (default /tmp) and is deleted at the end unless --keep.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORDS = (
    "the a of to and in is it that for on with as was at by be this from or an are not but have you "
    "model token draft head target tree verify accept reject sample cache layer hidden state batch loss "
    "python data stream memory file record chat user assistant answer question because which would there"
).split()


def synthetic_lines(n_distinct: int, seed: int = 0) -> list[str]:
    """Distinct JSON lines (2-4 turns, ~3 kB) with an `{ID}` hole for the id."""
    rng = random.Random(seed)
    text = lambda n: " ".join(rng.choice(WORDS) for _ in range(n))  # noqa: E731
    lines = []
    for _ in range(n_distinct):
        messages = []
        for _ in range(rng.randint(1, 2)):
            messages += [{"role": "user", "content": text(rng.randint(20, 120))}, {"role": "assistant", "content": text(rng.randint(150, 400))}]
        lines.append(json.dumps({"id": "{ID}", "messages": messages}))
    return lines


def write_file(path: Path, size_bytes: int, seed: int = 0) -> int:
    """Append records until the file holds `size_bytes`; returns the number of records."""
    lines = synthetic_lines(500, seed)
    n = 0
    with open(path, "w") as f:
        while f.tell() < size_bytes:
            f.write("".join(line.replace("{ID}", f"r{n + i}", 1) + "\n" for i, line in enumerate(lines)))
            n += len(lines)
    return n


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kB on Linux


def smollm2_tokenizer():
    from transformers import AutoTokenizer

    from drafthead.ground.target.load import BUILTIN_TARGETS, _builtin_folder

    return AutoTokenizer.from_pretrained(_builtin_folder(BUILTIN_TARGETS["smollm2-135m"]), local_files_only=True)


# ---------------------------------------------------------------------------------------------- one measurement each


def measure_baseline(path: str) -> dict:
    import importlib

    importlib.import_module("drafthead.train.data.streaming")  # what `stream` imports (chat_format, sources too)
    smollm2_tokenizer()
    return {}


def measure_read(path: str) -> dict:
    from drafthead.train.data.sources import SourceReport, iter_conversations

    t = time.time()
    report = SourceReport(source=path)
    n = sum(1 for _ in iter_conversations(Path(path), "json", report, rename_duplicates=False))
    return {"conversations": n, "seconds": time.time() - t}


def measure_stream(path: str, samples: int, max_length: int, batch_size: int) -> dict:
    from drafthead.train.data.streaming import TokenStream

    tokenizer = smollm2_tokenizer()
    base = peak_rss_mb()
    stream = TokenStream("json", path, tokenizer, max_length, eval_size=64, shuffle_buffer=1000)
    t, n, tokens = time.time(), 0, 0
    stream.eval_samples()
    for batch in stream.batches(batch_size, seed=0, epoch=0):
        n += len(batch)
        tokens += sum(len(s["input_ids"]) for s in batch)
        if n >= samples:
            break
    seconds = time.time() - t
    # the shuffle buffer and the eval set are read (and tokenized) ahead of the samples yielded
    tokenized = stream.report.conversations + 64
    return {
        "samples": n,
        "tokens": tokens,
        "tokenized": tokenized,
        "seconds": seconds,
        "tokenized_per_s": tokenized / seconds,
        "rss_after_tokenizer_mb": base,
    }


def measure_load(path: str) -> dict:
    from drafthead.train.data.sources import load_conversations

    with tempfile.TemporaryDirectory(prefix="dh-rss-cache-") as cache:
        os.environ["DRAFTHEAD_CACHE"] = cache  # a cold cache, deleted afterwards
        t = time.time()
        ds, _ = load_conversations("json", path)
        return {"conversations": len(ds), "seconds": time.time() - t}


def measure_list(path: str) -> dict:
    from drafthead.train.data.sources import read_conversations

    t = time.time()
    rows, _ = read_conversations(Path(path))
    return {"conversations": len(rows), "seconds": time.time() - t}


def measure_cached(path: str, max_length: int) -> dict:
    from drafthead.train.data.chat_format import tokenize_conversations
    from drafthead.train.data.sources import load_conversations

    tokenizer = smollm2_tokenizer()
    with tempfile.TemporaryDirectory(prefix="dh-rss-cache-") as cache:
        os.environ["DRAFTHEAD_CACHE"] = cache  # a cold cache, deleted afterwards
        t = time.time()
        ds, _ = load_conversations("json", path)
        _, report = tokenize_conversations(ds, tokenizer, max_length)
        seconds = time.time() - t
    return {"samples": report.kept, "seconds": seconds, "samples_per_s": report.kept / seconds}


def child(args) -> None:
    import datasets

    datasets.disable_progress_bars()
    what = {
        "baseline": lambda: measure_baseline(args.child_path),
        "read": lambda: measure_read(args.child_path),
        "stream": lambda: measure_stream(args.child_path, args.samples, args.max_length, args.batch_size),
        "load": lambda: measure_load(args.child_path),
        "cached": lambda: measure_cached(args.child_path, args.max_length),
        "list": lambda: measure_list(args.child_path),
    }[args.child]
    result = what()
    result["peak_rss_mb"] = peak_rss_mb()
    print(json.dumps(result))


def run_child(kind: str, path: Path, args) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--child",
        kind,
        "--child-path",
        str(path),
        "--samples",
        str(args.samples),
        "--max-length",
        str(args.max_length),
        "--batch-size",
        str(args.batch_size),
    ]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=dict(os.environ, TOKENIZERS_PARALLELISM="false"))
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=1.5, help="size of the big synthetic file")
    ap.add_argument("--samples", type=int, default=3000, help="training samples to stream and tokenize")
    ap.add_argument("--small-mb", type=float, default=40, help="size of the file for the non-streaming comparison; 0: skip")
    ap.add_argument("--max-length", type=int, default=1024)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--dir", default="/tmp")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--child", choices=["baseline", "read", "stream", "load", "cached", "list"], help=argparse.SUPPRESS)
    ap.add_argument("--child-path", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)

    big = Path(args.dir) / "drafthead-streaming-rss.jsonl"
    small = Path(args.dir) / "drafthead-streaming-rss-small.jsonl"
    try:
        t = time.time()
        records = write_file(big, int(args.gb * 1e9))
        print(f"wrote {big}: {big.stat().st_size / 1e6:.0f} MB, {records} records in {time.time() - t:.1f} s")
        for kind in ("baseline", "read", "stream", "load"):
            print(kind, json.dumps(run_child(kind, big, args)), flush=True)
        if args.small_mb > 0:
            records = write_file(small, int(args.small_mb * 1e6))
            print(f"wrote {small}: {small.stat().st_size / 1e6:.0f} MB, {records} records")
            for kind in ("cached", "list"):
                print(kind, json.dumps(run_child(kind, small, args)), flush=True)
    finally:
        if not args.keep:
            for path in (big, small):
                path.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
