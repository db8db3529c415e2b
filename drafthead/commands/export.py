"""`drafthead export HEAD_DIR --format FMT --out DIR`: write a trained head in the layout a serving
engine loads (the work is `heads.formats.export_head`; docs/formats.md lists the layouts)."""

from __future__ import annotations

from . import DeclaredChoices, add_overwrite_option, note

DTYPES = ("keep", "float32", "bfloat16", "float16")


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("export", help="write a trained head for vLLM, SGLang, llama.cpp, speculators, EAGLE, Medusa")
    p.add_argument("head_dir", metavar="HEAD_DIR", help="a head folder written by `drafthead train`")
    p.add_argument(
        "--format",
        choices=DeclaredChoices("drafthead.heads.formats", "EXPORT_FORMATS"),
        required=True,
        metavar="FMT",
        help="target layout: %(choices)s (docs/formats.md)",
    )
    p.add_argument("--out", required=True, metavar="DIR", help="output folder (created; a non-empty one needs --overwrite)")
    add_overwrite_option(p)
    p.add_argument("--dtype", choices=DTYPES, default="keep", help="cast the weights (default: keep the saved dtype)")
    p.add_argument(
        "--target",
        default=None,
        help="the head's target (name or folder), for layouts that store a copy of its tensors: speculators and "
        "eagle (embed_tokens), medusa with a shared LM head, mtp (the target's config, embedding and LM head)",
    )


def run(args) -> int:
    import torch

    from ..heads.formats import export_head
    from ..ground.outdir import check_distinct, check_output, check_replaceable

    check_run_folder(args.head_dir)
    check_distinct(args.head_dir, args.out)  # before the target loads: a refusal costs nothing
    check_output(args.out, overwrite=args.overwrite, what="export folder")
    if args.overwrite:
        check_replaceable(args.out, inputs=[args.head_dir, args.target], what="export folder")
    dtype = None if args.dtype == "keep" else getattr(torch, args.dtype)
    target_model = None
    if args.target is not None:
        from ..ground.target.load import load_target

        target_model = load_target(args.target).model
    out = export_head(args.head_dir, args.out, args.format, dtype=dtype, target_model=target_model, overwrite=args.overwrite)
    note(f"wrote {args.format} layout to {out}")
    return 0


def check_run_folder(head_dir: str) -> None:
    """A training run's output_dir given for its head: name the head folders inside it."""
    from pathlib import Path

    from ..heads.io import CONFIG_NAME
    from ..train.loop.best import BEST_DIR
    from ..train.loop.trainer import FINAL_DIR

    folder = Path(head_dir)
    if folder.is_dir() and not (folder / CONFIG_NAME).exists():
        heads = [p for p in (folder / FINAL_DIR, folder / BEST_DIR) if (p / CONFIG_NAME).exists()]
        if heads:
            raise ValueError(f"{folder} is a training run's folder, not a head: export its head, " + " or ".join(str(p) for p in heads))
