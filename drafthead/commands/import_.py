"""`drafthead import SRC --target T --out DIR`: read a head another trainer or engine published
(speculators, EAGLE-3 research layout, upstream EAGLE-1 / Medusa, ...) into one of our head
folders (the work is `heads.formats.import_to_folder`; docs/formats.md lists the layouts)."""

from __future__ import annotations

from . import DeclaredChoices, add_overwrite_option, add_target_options, load_target_from_args, note

DTYPES = ("keep", "float32", "bfloat16", "float16")


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("import", help="convert a published head (engine or upstream layout) into a drafthead head")
    p.add_argument("src", metavar="SRC", help="the foreign head folder")
    p.add_argument("--out", required=True, metavar="DIR", help="output head folder (created; a non-empty one needs --overwrite)")
    p.add_argument(
        "--convention",
        choices=DeclaredChoices("drafthead.heads.formats", "CONVENTIONS"),
        default=None,
        metavar="NAME",
        help="%(choices)s: how SRC's producer counted what its layout leaves open: EAGLE-3 aux-layer ids (vllm: "
        "vLLM/speculators/llama.cpp, sglang: SGLang/SpecForge) or an EAGLE-1 head's RoPE "
        "(eagle: upstream EAGLE, base 10000; vllm: the stated one)",
    )
    p.add_argument("--save-dtype", choices=DTYPES, default="keep", help="dtype of the saved weights (default: SRC's own)")
    add_overwrite_option(p)
    add_target_options(p)


def run(args) -> int:
    import torch

    from ..heads.formats import import_to_folder
    from ..ground.outdir import check_distinct, check_output, check_replaceable

    check_distinct(args.src, args.out)  # before the target loads: a refusal costs nothing
    check_output(args.out, overwrite=args.overwrite, what="import folder")
    if args.overwrite:
        check_replaceable(args.out, inputs=[args.src, args.target], what="import folder")
    target = load_target_from_args(args)
    dtype = None if args.save_dtype == "keep" else getattr(torch, args.save_dtype)
    out, notes = import_to_folder(
        args.src, args.out, target.model, target.tokenizer, target_name=target.name, convention=args.convention, dtype=dtype, overwrite=args.overwrite
    )
    for line in notes:
        note(line)
    note(f"wrote a drafthead head to {out}")
    return 0
