"""`drafthead demo`: SmolLM2-135M on the CPU, plain vs speculative decoding, one prompt."""

from __future__ import annotations

import textwrap

from . import (
    add_proposer_options,
    add_target_options,
    draft_spec_from_args,
    drafting_from_args,
    engine_options,
    load_target_from_args,
    note,
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
    # identical output at the dtype the demo runs (bf16 where the CPU has it): the row-invariant
    # kernels, with plain decoding through them as the reference; --no-row-invariant: the fastest
    # kernels against transformers' generate()
    p.set_defaults(row_invariant=True)


def run(args) -> int:
    from ..inference.bench.run import BenchSettings, run_bench
    from ..inference.bench.prompts import Prompt
    from ..inference.bench.report import plain_label
    from ..inference.engine.sampling import SamplingConfig
    from ..ground.target.identity import eos_token_ids

    spec = draft_spec_from_args(args)
    if args.backend == "llama.cpp" and args.row_invariant:  # the default: row invariance is our torch kernels'
        args.row_invariant = False
        note(
            "llama.cpp backend: ggml's kernels, which are not row-invariant; plain decoding on the same backend "
            "is the reference (docs/llamacpp-backend.md)"
        )
    note(f"loading {args.target} ({resolve_dtype_arg(args)}, {args.threads} threads); the first run dequantizes it (~20 s)")
    loaded = load_target_from_args(args)
    drafting = drafting_from_args(args, spec, loaded, SamplingConfig())  # --backend llama.cpp: libllama verifies
    note(drafting.message)  # once the drafter is built: a head that cannot draft is the only line
    factory, model, verifier, proposer, head = (drafting.factory, drafting.model, drafting.verifier, drafting.spec.proposer, drafting.spec.head)
    settings = BenchSettings(
        max_new_tokens=args.max_new_tokens,
        eos_token_ids=eos_token_ids(model, loaded.tokenizer),
        keep_text=True,
        progress=False,
        info={"target": loaded.name, "proposer": proposer, "head": head, "backend": args.backend},
        sizing=drafting.sizing,
        engine=engine_options(args),
        verifier=None if verifier is model else verifier,
    )
    report = run_bench(model, loaded.tokenizer, factory, [Prompt(DEMO_PROMPT, "coding", "demo")], settings)
    record = report["prompts"][0]
    plain = plain_label(report["settings"])
    print("prompt:\n" + textwrap.indent(textwrap.fill(DEMO_PROMPT, 96), "  "))
    if not record["identical"]:  # first: a speedup over two different texts says nothing
        print(
            f"\noutputs identical to {plain}: no, first difference at token {record['first_difference']}"
            + (
                " (in bfloat16 a multi-token forward can flip near-ties: --row-invariant keeps them equal)"
                if args.dtype != "float32" and not args.row_invariant and args.backend == "torch"
                else ""
            )
        )
        shared = record["shared_tokens"]
        if shared:
            print(
                f"over the {shared} tokens both sides share: plain {shared / record['plain_seconds_shared']:.1f} tokens/s, "
                f"speculative {shared / record['seconds_shared']:.1f} tokens/s, speedup {report['shared_speedup']:.2f}x; "
                "the figures below compare two different texts"
            )
    print("\nanswer (speculative):\n" + textwrap.indent(record["output"].strip(), "  "))
    print()
    print(f"{plain + ':':26s} {report['baseline_tokens_per_s']:6.1f} tokens/s  ({record['plain_new_tokens']} tokens)")
    print(f"{'speculative (' + proposer + '):':26s} {report['tokens_per_s']:6.1f} tokens/s  ({record['new_tokens']} tokens, tau {report['tau']:.2f})")
    print(f"speedup: {report['speedup']:.2f}x")
    if record["identical"]:
        print(f"outputs identical to {plain}: yes, token for token")
    return 0
