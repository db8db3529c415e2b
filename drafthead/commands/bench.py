"""`drafthead bench`: plain generate() vs speculative decoding over a prompt set; JSON report."""

from __future__ import annotations

import os
from pathlib import Path

from . import (
    draft_spec_from_args,
    drafting_from_args,
    add_overwrite_option,
    add_proposer_options,
    add_sampling_options,
    add_target_options,
    engine_options,
    load_target_from_args,
    note,
    sampling_from_args,
    torch_threads,
)


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("bench", help="benchmark speculative decoding against plain generate()")
    p.add_argument(
        "--dataset",
        default="mt-bench",
        help="mt-bench; edits (ShareGPT requests whose answers copy the prompt: rewrite, fix, proofread; "
        "where prompt lookup pays); or a .jsonl prompt file (default mt-bench)",
    )
    p.add_argument("--limit", type=int, default=None, help="first N prompts only")
    p.add_argument("--out", default=None, metavar="JSON", help="write the report here")
    p.add_argument("--plot", default=None, metavar="PNG", help="acceptance / tau / tokens-per-second figure")
    p.add_argument("--markdown", default=None, metavar="MD", help="write the summary table as Markdown")
    p.add_argument("--profile", action="store_true", help="exact per-phase engine timings (syncs the device)")
    p.add_argument(
        "--compare",
        choices=("hf-prompt-lookup", "llama.cpp", "vllm"),
        action="append",
        default=[],
        help="also time HF's own prompt lookup, or the same prompts through llama.cpp (plain and its "
        "n-gram drafting) / vLLM's CPU build, from their own venvs (`make interop`; greedy, batch 1)",
    )
    p.add_argument("--warmup-tokens", type=int, default=8, help="untimed warm-up generation length (0: none)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--batch-size",
        type=int,
        default=None,
        metavar="B",
        help="decode B prompts at a time, plain batched generate() vs ours batched (and ours with no "
        "drafting); reports total tokens/s, per-row tau, identical share and peak RSS",
    )
    add_overwrite_option(p)
    add_target_options(p)
    add_proposer_options(p)
    add_sampling_options(p)


def run(args) -> int:
    from ..inference.bench.run import BenchSettings, run_bench
    from ..inference.bench.prompts import load_prompts
    from ..inference.bench.edit_prompts import EDITS, edit_prompts
    from ..train.data.sources import sharegpt_chats
    from ..inference.bench.report import format_table, plot_report, report_json, report_markdown
    from ..ground.target.identity import eos_token_ids

    check_report_paths(args)
    spec = draft_spec_from_args(args)
    # before the model: bad input fails fast
    prompts = edit_prompts(sharegpt_chats(), args.limit) if args.dataset == EDITS else load_prompts(args.dataset, args.limit)
    sampling = sampling_from_args(args)
    external = [e for e in args.compare if e in EXTERNAL_ENGINES]
    if external and not sampling.greedy:
        raise ValueError(f"--compare {' / '.join(external)} runs greedy decoding only; drop --temperature")
    if external and args.batch_size is not None:
        raise ValueError(f"--compare {' / '.join(external)} runs one prompt at a time; drop --batch-size")
    loaded = load_target_from_args(args)
    drafting = drafting_from_args(args, spec, loaded, sampling)
    note(drafting.message)  # once the drafter is built: a head that cannot draft is the only line
    factory, model, verifier, spec = drafting.factory, drafting.model, drafting.verifier, drafting.spec
    settings = BenchSettings(
        max_new_tokens=args.max_new_tokens,
        sampling=sampling,
        seed=args.seed,
        eos_token_ids=eos_token_ids(model, loaded.tokenizer),
        compare_hf_prompt_lookup="hf-prompt-lookup" in args.compare,
        profile=args.profile,
        warmup_tokens=args.warmup_tokens,
        progress=not args.no_progress,
        engine=engine_options(args),
        verifier=None if verifier is model else verifier,
        info={
            "target": loaded.name,
            "target_path": str(loaded.path),
            "dtype": args.dtype,
            "round_weights": args.round_weights,
            "threads": args.threads,
            # OpenMP's idle-thread policy moves every absolute number here (PASSIVE: idle threads
            # sleep, and waking them for each small op made both plain and speculative ~1.45x slower)
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "default"),
            "proposer": spec.proposer,
            "head": spec.head,
            "draft_model": spec.draft_model,
            "num_draft": spec.num_draft,
            "sizing": spec.sizing,
            "backend": args.backend,
            "gguf": None if verifier is model else str(verifier.path),
            "dataset": args.dataset,
            "limit": args.limit,
            **engine_options(args),
        },
    )
    example = factory()
    if hasattr(example, "describe"):
        settings.info["drafter"] = example.describe()  # the effective settings, drafting.json included
    settings.sizing = drafting.sizing
    if args.batch_size is not None:
        return _run_batched(args, model, loaded.tokenizer, factory, prompts, settings)
    report = run_bench(model, loaded.tokenizer, factory, prompts, settings)
    if external:
        report["engines"] = _external(external, args, loaded, prompts, settings, report)
    if args.out:
        write_text(args.out, report_json(report))
        note(f"report: {args.out}")
    if args.markdown:
        write_text(args.markdown, report_markdown(report))
        note(f"markdown: {args.markdown}")
    if args.plot:
        note(f"plot: {plot_report(report, args.plot)}")
    print(format_table(report, profile=args.profile))
    for name, row in report.get("engines", {}).get("tokens_per_s", {}).items():
        if name not in OUR_SIDE:  # those two are in the table above
            print(f"{name}: {row:.1f} tokens/s (the same prompts, run after ours)")
    for name, why in report.get("engines", {}).get("skipped", {}).items():
        note(f"--compare {name} skipped: {why}")
    return 0


EXTERNAL_ENGINES = ("llama.cpp", "vllm")
OUR_SIDE = ("ours speculative", "transformers generate()")


def _external(engines, args, loaded, prompts, settings, report) -> dict:
    """The same prompts through llama.cpp's own tools (inference/llamacpp/tools.py, built by
    `make llamacpp`) and vLLM (inference/vllm/plain_rows.py, its venv from `make interop`): tokens/s
    with prefill, as ours are counted, beside our own plain and speculative."""
    from ..inference.bench.prompts import encode_chat

    encoded = [encode_chat(loaded.tokenizer, p) for p in prompts]
    texts = [loaded.tokenizer.decode(ids[0]) for ids in encoded]
    rows: dict[str, dict] = {}
    skipped: dict[str, str] = {}
    if "llama.cpp" in engines:
        rows.update(_llamacpp_rows(args, loaded, texts, settings, skipped))
    if "vllm" in engines:
        more, why = _vllm_rows(args, loaded, encoded, settings)
        rows.update(more)
        skipped.update(why)
    speeds = {name: sum(r["tokens"] for r in rs) / sum(r["seconds"] for r in rs) for name, rs in rows.items()}
    speeds = dict(zip(OUR_SIDE, (report["tokens_per_s"], report["baseline_tokens_per_s"]))) | speeds
    return {"tokens_per_s": speeds, "skipped": skipped, "rows": rows}


def _llamacpp_rows(args, loaded, texts, settings, skipped) -> dict:
    from ..proposers import head_layout
    from ..heads.formats import formats_for
    from ..inference.llamacpp import lib, tools
    from ..inference.llamacpp.convert import DTYPE_GGUF

    why = lib.why_unavailable()
    if why is not None:
        skipped["llama.cpp"] = why
        return {}
    head = settings.info.get("head")
    layout, kind = head_layout(Path(head)) if head else (None, None)
    # a head of ours that llama.cpp's converter takes also drafts in llama.cpp's own speculative tool
    eagle3 = Path(head) if layout == "ours" and "llama.cpp" in formats_for(str(kind)) else None
    return tools.compare_rows(
        Path(loaded.path),
        args.gguf_type or DTYPE_GGUF[args.dtype],
        texts,
        settings.max_new_tokens,
        args.threads or torch_threads(),
        eagle3_head=eagle3,
        progress=settings.progress,
    )


def _vllm_rows(args, loaded, encoded, settings) -> tuple[dict, dict]:
    from ..inference.vllm.plain_rows import vllm_rows

    return vllm_rows(
        Path(loaded.path),
        [ids[0].tolist() for ids in encoded],
        list(settings.eos_token_ids),
        settings.max_new_tokens,
        args.dtype,
        args.threads or torch_threads(),
        Path(args.out).parent / "engines" if args.out else Path("out/engines"),
    )


def _run_batched(args, model, tokenizer, factory, prompts, settings) -> int:
    from ..inference.bench.batch import format_batch_table, run_batch_bench
    from ..inference.bench.report import report_json

    name = "policy" if settings.sizing == "policy" else "speculative"
    report = run_batch_bench(model, tokenizer, {name: (factory, settings.sizing)}, prompts, settings, args.batch_size)
    if args.out:
        write_text(args.out, report_json(report))
        note(f"report: {args.out}")
    print(format_batch_table(report))
    return 0


def check_report_paths(args) -> None:
    """--out, --markdown and --plot: refused when one holds a file (without --overwrite), is one
    of the bench's inputs (the --dataset file, the head) or a file bench did not write (with it),
    or names the same file as another."""
    from ..ground.outdir import check_output, check_replaceable
    from ..inference.bench.report import written_by_bench

    given = {option: path for option, path in (("--out", args.out), ("--markdown", args.markdown), ("--plot", args.plot)) if path is not None}
    seen: dict[Path, str] = {}
    for option, path in given.items():
        if Path(path).exists() and Path(path).is_dir():
            raise ValueError(f"{option} {path} is a folder: name the file to write")
        check_output(path, overwrite=args.overwrite, what=option)
        if args.overwrite:
            check_replaceable(path, inputs=[args.dataset, args.head, args.target], what=option, own=written_by_bench)
        key = Path(path).resolve()
        if key in seen:
            raise ValueError(f"{seen[key]} and {option} both name {path}: give each its own file")
        seen[key] = option


def write_text(path: str, text: str) -> None:
    """A report file, whole or not at all (a temp file renamed in: Ctrl-C leaves the old one)."""
    from ..ground.files import atomic_write

    atomic_write(Path(path), lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))
