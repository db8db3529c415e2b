"""`drafthead export HEAD_DIR --format ours|vllm|sglang --out DIR`: write a trained head in the
layout a serving engine loads (the work is `heads.export.export_head`)."""
from __future__ import annotations

from . import note

DTYPES = ("keep", "float32", "bfloat16", "float16")


def add_parser(subparsers) -> None:
    from ..heads.export import FORMATS

    p = subparsers.add_parser("export", help="write a trained head for vLLM / SGLang (or re-save ours)")
    p.add_argument("head_dir", metavar="HEAD_DIR", help="a head folder written by `drafthead train`")
    p.add_argument("--format", choices=FORMATS, required=True, help="target layout")
    p.add_argument("--out", required=True, metavar="DIR", help="output folder (created)")
    p.add_argument("--dtype", choices=DTYPES, default="keep", help="cast the weights (default: keep the saved dtype)")
    p.add_argument(
        "--target",
        default=None,
        help="the target (name or folder); only needed for a Medusa head that shares the target's LM head",
    )


def run(args) -> int:
    import torch

    from ..heads.export import export_head

    dtype = None if args.dtype == "keep" else getattr(torch, args.dtype)
    target_model = None
    if args.target is not None:
        from ..targets import load_target

        target_model = load_target(args.target).model
    out = export_head(args.head_dir, args.out, args.format, dtype=dtype, target_model=target_model)
    note(f"wrote {args.format} layout to {out}")
    return 0
