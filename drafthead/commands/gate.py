"""`drafthead gate`: does a candidate head beat the live one on recent traffic? Both replayed on the
same answers as the engine counts its rounds; exit 0 when the candidate wins by --margin, 1 when it
does not (a train-serve check in front of a deploy; docs/training.md "The loop offline")."""

from __future__ import annotations

import json
from pathlib import Path

from . import _int, _positive_int, add_device_option, load_target_from_args, note


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("gate", help="replay a live and a candidate head on recent traffic; exit 1 unless the candidate wins")
    p.add_argument("--live", required=True, metavar="DIR", help="the head serving now")
    p.add_argument("--candidate", required=True, metavar="DIR", help="the head that would replace it")
    p.add_argument("--data", required=True, metavar="FILE", help="recent traffic: a served-traffic log or any chat file `train` reads")
    p.add_argument("--target", default=None, help="the target (default: the one the live head was trained for)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "auto"), default="float32")
    p.add_argument("--threads", type=_positive_int, default=None)
    add_device_option(p)
    p.add_argument("--limit", type=_positive_int, default=64, help="conversations replayed (default 64)")
    p.add_argument("--max-new-tokens", type=_positive_int, default=128, help="the target's answer per prompt (default 128)")
    p.add_argument("--chain", type=_int, default=None, metavar="K", help="replay a chain of K drafts (default: each head's drafting.json)")
    p.add_argument("--margin", type=float, default=0.0, help="the relative tau gain the candidate must show (default 0: any gain)")
    p.add_argument("--json", action="store_true", help="print the figures as one JSON object")


def run(args) -> int:
    from ..ground.files import read_json
    from ..train.adapt.offline import gate_heads
    from ..train.data.chat_format import tokenize_conversations
    from ..train.data.samples import TokenDataset
    from ..train.data.sources import load_conversations

    for name in ("live", "candidate"):
        if not (Path(getattr(args, name)) / "config.json").is_file():
            raise FileNotFoundError(f"--{name} {getattr(args, name)}: no head folder (config.json) there")
    if not Path(args.data).is_file():
        raise FileNotFoundError(f"--data {args.data}: no such file")
    if not 0 <= args.margin < 10:
        raise ValueError(f"--margin must be in [0, 10), got {args.margin}")
    if args.target is None:
        args.target = read_json(Path(args.live) / "config.json").get("config", {}).get("target", {}).get("name")
        if not args.target:
            raise ValueError(f"{args.live} does not name its target: pass --target")
    drafting = (head_drafting(args.live, args.chain), head_drafting(args.candidate, args.chain))
    conversations, report = load_conversations("file", args.data, args.limit)
    note(report.summary())
    loaded = load_target_from_args(args)
    tokenized, _ = tokenize_conversations(conversations, loaded.tokenizer, 4096)
    result = gate_heads(
        Path(args.live),
        Path(args.candidate),
        loaded,
        TokenDataset(tokenized),
        sequences=args.limit,
        max_new_tokens=args.max_new_tokens,
        margin=args.margin,
        drafting=drafting,
    )
    if args.json:
        print(json.dumps(result.to_dict()))
    else:
        print(f"live tau {result.live_tau:.3f}  candidate tau {result.candidate_tau:.3f}  ({result.sequences} answers, {result.rounds} rounds)")
        print(("PASS: " if result.passed else "FAIL: ") + result.reason)
    return 0 if result.passed else 1


def head_drafting(folder: str, chain: int | None):
    """How the head at `folder` drafts in the replay: as its drafting.json says, its tree replaced
    by a chain of `chain` when given (DraftSpec resolves it, checked before the target loads)."""
    from ..draft_spec import DraftSpec

    spec, kind = DraftSpec(proposer="head", head=folder, chain=chain).with_head_folder()
    assert kind is not None  # a head folder: run() checked its config.json
    return spec.head_drafting(kind)
