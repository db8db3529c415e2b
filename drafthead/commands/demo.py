"""`drafthead demo`: SmolLM2-135M on the CPU, plain generate() vs speculative, one prompt."""
from __future__ import annotations

import textwrap

from . import (
    add_proposer_options,
    check_drafting_args,
    add_target_options,
    choose_proposer,
    drafter_factory_from_args,
    engine_options,
    load_target_from_args,
    note,
    policy_from_args,
    resolve_dtype_arg,
)

# An MT-bench-style coding question: answers quote the prompt's identifiers, as real ones do.
DEMO_PROMPT = (
    "Write a Python function `count_words(text)` that returns a dictionary mapping each word in "
    "`text` to the number of times it appears, ignoring case and punctuation. Then show how to "
    "call `count_words` on a short example sentence."
)


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("demo", help="SmolLM2-135M: plain vs speculative generation on one prompt")
    p.add_argument("--max-new-tokens", type=int, default=256)
    # auto: bf16 only where the CPU has bf16 instructions; emulated bf16 is slower than fp32
    # (docs/cpu-measurements.md)
    add_target_options(p, dtype="auto", threads=2)
    add_proposer_options(p)


def run(args) -> int:
    from ..inference.bench.run import BenchSettings, run_bench
    from ..inference.bench.prompts import Prompt
    from ..inference.engine.sampling import SamplingConfig
    from ..inference.engine.targets import eos_token_ids

    check_drafting_args(args)
    note(f"loading {args.target} ({resolve_dtype_arg(args)}, {args.threads} threads); the first run dequantizes it (~20 s)")
    loaded = load_target_from_args(args)
    proposer, head, message = choose_proposer(args, loaded.name)
    factory, model = drafter_factory_from_args(args, loaded, SamplingConfig(), proposer, head)
    note(message)  # once the drafter is built: a head that cannot draft is the only line
    settings = BenchSettings(
        max_new_tokens=args.max_new_tokens,
        eos_token_ids=eos_token_ids(model, loaded.tokenizer),
        keep_text=True,
        progress=False,
        info={"target": loaded.name, "proposer": proposer, "head": head},
        policy=policy_from_args(args, model, factory()),  # --num-draft auto
        engine=engine_options(args),
    )
    report = run_bench(model, loaded.tokenizer, factory, [Prompt(DEMO_PROMPT, "coding", "demo")], settings)
    record = report["prompts"][0]
    print("prompt:\n" + textwrap.indent(textwrap.fill(DEMO_PROMPT, 96), "  "))
    print("\nanswer (speculative):\n" + textwrap.indent(record["output"].strip(), "  "))
    print()
    print(f"plain generate():      {report['baseline_tokens_per_s']:6.1f} tokens/s  ({record['plain_new_tokens']} tokens)")
    print(
        f"speculative ({proposer}): {report['tokens_per_s']:6.1f} tokens/s  ({record['new_tokens']} tokens, "
        f"tau {report['tau']:.2f})"
    )
    print(f"speedup: {report['speedup']:.2f}x")
    if record["identical"]:
        print("outputs identical to plain generate(): yes, token for token")
    else:
        print(
            f"outputs identical to plain generate(): no, first difference at token {record['first_difference']}"
            + (" (in bfloat16 a multi-token forward can flip near-ties; use --dtype float32 for exact equality)"
               if args.dtype == "bfloat16" else "")
        )
    return 0
