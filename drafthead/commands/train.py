"""`drafthead train --config configs/x.yaml [key=value ...] [--resume]`.

Also what `accelerate launch -m drafthead train ...` runs (drafthead/__main__.py): the same
arguments, one process per device, each loading the target on its own device.
"""

from __future__ import annotations

import argparse
import sys

from . import add_overwrite_option


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="a YAML run config or a preset name (configs/NAME.yaml)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides, e.g. lr=3e-4 data.limit=2000 head.num_heads=3")
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest checkpoint in output_dir; its config must agree, except logging, "
        "eval and checkpoint cadence, max_steps/epochs and wandb (docs/reliability.md)",
    )
    add_overwrite_option(parser)
    parser.add_argument(
        "--plan",
        default=None,
        metavar="CONFIG_JSON",
        help="do not train: print per-rank memory under DDP and FSDP for this target config.json "
        "(e.g. configs/targets/llama-3.1-8b.json), built on the meta device",
    )
    parser.add_argument(
        "--ranks",
        default=None,
        help="with --plan: process counts, multiples of context_parallel (default: 1, 8 and 64 data-parallel replicas of context_parallel ranks)",
    )


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "train",
        help="train a draft head on the target (runs under accelerate launch too)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(p)


def _rank_counts(text: str | None) -> tuple[int, ...] | None:
    """--ranks 1,8,64 -> (1, 8, 64); None: the plan's default."""
    if text is None:
        return None
    try:
        counts = tuple(int(r) for r in text.split(","))
    except ValueError:
        raise ValueError(f"--ranks takes process counts separated by commas (1,8,64), got {text!r}") from None
    if min(counts) < 1:
        raise ValueError(f"--ranks takes process counts >= 1, got {text!r}")
    return counts


def run(args) -> int:
    from ..train.loop.config import load_config
    from ..train.loop.run import run_training
    from ..train.loop.trainer import NonFiniteLossError

    config = load_config(args.config, args.overrides)
    if args.plan:
        from ..train.loop.plan import plan_table

        print(plan_table(config, args.plan, _rank_counts(args.ranks)))
        return 0
    try:
        result = run_training(config, resume=args.resume, overwrite=args.overwrite, inputs=(args.config,))
    except NonFiniteLossError as e:
        print(f"drafthead train: {e}", file=sys.stderr)
        return 1
    if result.final_dir is not None:
        from accelerate import PartialState

        if PartialState().is_main_process:
            print(f"head saved to {result.final_dir}")
    from ..train.capture.workshare import end_process_group

    end_process_group()
    return 0
