"""Our engine beside the engines a CPU user would pick instead, on the same prompts in one run.

    .venv/bin/python scripts/interop/compare_engines.py --prompts 80 --max-new-tokens 128 --out out/engines

Batch 1, greedy, the first turns of MT-bench rendered with the target's chat template (token ids
as inference/bench/prompts.py `encode_chat` makes them), SmolLM2-135M, one dtype and thread count for all:
  - transformers `generate()`;
  - ours with no drafting (the same engine, root-only trees), ours speculative with the shipped head's
    fixed tree, and ours with the load policy (`--sizing policy`: each round's node count from
    the measured forward cost, down to plain decoding);
  - llama.cpp plain decoding (llama-completion) and with its own n-gram drafting
    (llama-speculative-simple --spec-type ngram-simple), built by `make llamacpp`
    (inference/llamacpp/tools.py);
  - vLLM's CPU build, plain, one request at a time, in its own venv (scripts/interop/setup_vllm.sh;
    inference/vllm/plain_rows.py, which `drafthead bench --compare vllm` runs too).
The first four run prompt by prompt, interleaved; vLLM runs after them in a child process (it
cannot share this process's torch). Tokens/s count prefill: ours and generate() are timed wall to
wall around the call, llama.cpp by its own prompt and decode timers (model load excluded), vLLM
wall to wall around each `generate` (engine start excluded). Engines that are not installed are
skipped and named. Writes OUT/engines.json and OUT/engines.md.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=80)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    p.add_argument(
        "--llama-dtype",
        default=None,
        choices=("float32", "bfloat16"),
        help="llama.cpp's GGUF type (default: --dtype); each engine can run its own fastest",
    )
    p.add_argument(
        "--round-weights",
        default=None,
        choices=("bfloat16",),
        help="ours and transformers run the target's weights rounded to bf16 values in --dtype: the "
        "weights llama.cpp's bf16 GGUF holds (ground/target/load.py round_to_bfloat16)",
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--engines", default="hf,ours,llama.cpp,vllm")
    p.add_argument("--out", default="out/engines")
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------------
# llama.cpp
# ---------------------------------------------------------------------------------------------


def llama_engine(target: Path, dtype: str):
    """The target's GGUF in `dtype` (llama.cpp's converter, inference/llamacpp/convert.py), or a
    string: why llama.cpp is skipped."""
    from drafthead.inference.llamacpp import lib
    from drafthead.inference.llamacpp.convert import DTYPE_GGUF, target_gguf

    why = lib.why_unavailable()
    return why if why is not None else target_gguf(target, DTYPE_GGUF[dtype])


def add_llama_rows(rows: dict, gguf: Path, text: str, n: int, threads: int) -> None:
    """One prompt through llama.cpp's own tools, plain and with its n-gram drafting."""
    from drafthead.inference.llamacpp import tools

    for name, run in ((tools.PLAIN_ROW, tools.plain), (tools.NGRAM_ROW, tools.ngram)):
        rows.setdefault(name, []).append(run(gguf, text, n, threads))


# ---------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------


def _cell(summary: dict, key: str, fmt: str) -> str:
    return format(summary[key], fmt) if key in summary else "-"


def main() -> int:
    args = parse_args()
    import torch
    from tqdm.auto import tqdm

    from drafthead.draft_spec import DraftSpec
    from drafthead.inference.engine.drafter import RootOnlyDrafter
    from drafthead.inference.engine.drafter import fork_drafter
    from drafthead.inference.bench.run import hf_generation_config
    from drafthead.inference.engine.generate import GenerationConfig, speculative_generate
    from drafthead.inference.bench.prompts import encode_chat, load_prompts
    from drafthead.inference.vllm.plain_rows import vllm_rows
    from drafthead.inference.engine.sampling import SamplingConfig
    from drafthead.ground.target.identity import eos_token_ids
    from drafthead.ground.target.load import load_target

    engines = args.engines.split(",")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    loaded = load_target("smollm2-135m", dtype=args.dtype, threads=args.threads, round_weights=args.round_weights)
    model, tokenizer = loaded.model, loaded.tokenizer
    drafter = DraftSpec(proposer="head").build(loaded).factory()
    eos = list(eos_token_ids(model, tokenizer))
    prompts = load_prompts("mt-bench", args.prompts)
    encoded = [encode_chat(tokenizer, p) for p in prompts]
    texts = [tokenizer.decode(ids[0]) for ids in encoded]
    n = args.max_new_tokens
    skipped: dict[str, str] = {}
    llama = None
    if "llama.cpp" in engines:
        llama = llama_engine(Path(loaded.path), args.llama_dtype or args.dtype)
        if isinstance(llama, str):
            skipped["llama.cpp"], llama = llama, None
    config = GenerationConfig(max_new_tokens=n, eos_token_ids=tuple(eos))
    policy_drafter = fork_drafter(drafter)  # its own state: the policy's rounds never touch the fixed tree's
    policy_config = GenerationConfig(max_new_tokens=n, eos_token_ids=tuple(eos), sizing="policy")
    hf_config = hf_generation_config(SamplingConfig(), n, eos, tokenizer.pad_token_id)

    def timed(fn):
        start = time.perf_counter()
        result = fn()
        return result, time.perf_counter() - start

    with torch.inference_mode():  # warm-up: first calls pay for allocations
        speculative_generate(model, drafter, encoded[0], GenerationConfig(max_new_tokens=8))
        speculative_generate(model, policy_drafter, encoded[0], policy_config)  # the policy's probes, untimed
        model.generate(encoded[0], attention_mask=torch.ones_like(encoded[0]), max_new_tokens=8, do_sample=False)
    rows: dict[str, list[dict]] = {}
    for ids, text in tqdm(list(zip(encoded, texts)), desc="engines", unit="prompt"):
        with torch.inference_mode():
            if "hf" in engines:
                res, s = timed(lambda: model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=hf_config))
                rows.setdefault("transformers generate()", []).append(
                    {"tokens": res.shape[1] - ids.shape[1], "seconds": s, "token_ids": res[0, ids.shape[1] :].tolist()}
                )
            if "ours" in engines:
                for name, run_drafter, run_config in (
                    ("ours, no drafting", RootOnlyDrafter(), config),
                    ("ours, shipped head + lookup", drafter, config),
                    ("ours, load policy", policy_drafter, policy_config),
                ):
                    res, s = timed(lambda: speculative_generate(model, run_drafter, ids, run_config))
                    rows.setdefault(name, []).append(
                        {"tokens": res.new_tokens.shape[1], "seconds": s, "rounds": res.num_rounds, "token_ids": res.new_tokens[0].tolist()}
                    )
        if llama is not None:
            add_llama_rows(rows, llama, text, n, args.threads)
    if "vllm" in engines:
        more, why = vllm_rows(Path(loaded.path), [ids[0].tolist() for ids in encoded], eos, n, args.dtype, args.threads, out)
        rows.update(more)
        skipped.update(why)
    reference = rows.get("ours, no drafting")
    summary = {name: {"tokens": sum(r["tokens"] for r in rs), "seconds": sum(r["seconds"] for r in rs)} for name, rs in rows.items()}
    for name, s in summary.items():
        s["tokens_per_s"] = s["tokens"] / s["seconds"]
        if all("rounds" in r for r in rows[name]):  # tau: tokens per verify forward (1 without drafting)
            s["tau"] = s["tokens"] / sum(r["rounds"] for r in rows[name])
        if reference and all("token_ids" in r for r in rows[name]):  # greedy output equal to ours without drafting
            s["identical"] = sum(r["token_ids"] == ref["token_ids"] for r, ref in zip(rows[name], reference))
    report = {"settings": vars(args) | {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z")}, "summary": summary, "skipped": skipped, "rows": rows}
    (out / "engines.json").write_text(json.dumps(report, indent=1) + "\n")
    rounded = f" with weights rounded to {args.round_weights}" if args.round_weights else ""
    lines = [
        f"SmolLM2-135M, {args.dtype}{rounded} (llama.cpp {args.llama_dtype or args.dtype}), {args.threads} threads, batch 1, greedy, "
        f"{len(encoded)} MT-bench first turns, "
        f"at most {n} new tokens; tokens/s with prefill; identical: prompts whose output equals ours without drafting.",
        "",
        "| engine | tokens | tokens/s | tau | identical |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    lines += [
        f"| {name} | {s['tokens']} | {s['tokens_per_s']:.1f} | {_cell(s, 'tau', '.2f')} | {_cell(s, 'identical', 'd')} |"
        for name, s in summary.items()
    ]
    lines += [f"- skipped {k}: {v}" for k, v in skipped.items()]
    (out / "engines.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
