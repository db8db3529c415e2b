"""`drafthead data ...`: prepare training data.

    drafthead data inspect --source sharegpt --limit 1000
    drafthead data regenerate --target smollm2-135m --source sharegpt --limit 2000 --out data/regen.jsonl \\
        --max-new-tokens 256 --temperature 0 --batch-size 8
    drafthead data regenerate --target /models/llama-3.1-8b --server http://gpu1:8000 http://gpu2:8000 \\
        --concurrency 32 --source sharegpt --out data/regen.jsonl      # vLLM, SGLang, llama-server
    drafthead data capture --config configs/eagle3.yaml data.path=data/regen.jsonl --out data/eagle3-features
    drafthead data tiny-target --out /tmp/tiny     # a tiny random target for smoke runs

`regenerate` and `capture` also run as several processes, each taking a share of the work:
    accelerate launch --multi_gpu --num_processes 2 -m drafthead.cli data capture ...
(docs/launching.md "Data work on several processes").
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
from pathlib import Path

from ..draft_spec import llamacpp_target
from ..train.regeneration.openai_client import RETRY_STATUS
from . import (
    _non_negative_int,
    _positive_float,
    _positive_int,
    add_device_option,
    add_overwrite_option,
    add_target_options,
    backend_device,
    launch_rank,
    load_target_from_args,
    note,
    require_backend,
    resolve_device,
)


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "data",
        help="load, regenerate (self-distill) and capture training data",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="data_command", metavar="ACTION", required=True)

    def source_options(q):
        q.add_argument(
            "--source",
            default="sharegpt",
            help="how --path is read (train/data/sources.py SOURCES): sharegpt (without --path: the package's file) | json | jsonl "
            "| regenerated (JSON or JSONL chats) | file (json, jsonl, parquet, csv, arrow or a save_to_disk folder, by the "
            'path); docs/models-and-data.md "Data formats"',
        )
        q.add_argument("--path", default=None, help="the data file (or save_to_disk folder) for --source")
        q.add_argument("--limit", type=_positive_int, default=None, help="first N usable conversations")

    q = sub.add_parser("inspect", help="load and normalise a source; print what was kept and dropped")
    source_options(q)

    q = sub.add_parser("regenerate", help="re-answer every user turn with the target itself (resumable)")
    # auto: float32 where bf16 is emulated (no AVX512-BF16/AMX), which answers faster there
    # (docs/cpu-measurements.md "Training throughput")
    add_target_options(q, dtype="auto")
    source_options(q)
    q.add_argument("--out", required=True, help="output JSONL (a rerun skips the ids it holds)")
    add_overwrite_option(q)
    q.add_argument("--max-new-tokens", type=_positive_int, default=512)
    q.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    q.add_argument("--top-p", type=float, default=1.0)
    q.add_argument("--batch-size", type=_positive_int, default=None, help="conversations answered together (default 8)")
    q.add_argument("--max-turns", type=_positive_int, default=None, help="answer at most this many user turns")
    q.add_argument("--max-prompt-tokens", type=_positive_int, default=None, help="stop a conversation whose prompt grows past this")
    q.add_argument("--seed", type=int, default=0)
    q.add_argument(
        "--speculative", action="store_true", help="answer through our batched speculative decoding with the target's shipped head (or --head)"
    )
    q.add_argument("--head", default=None, metavar="DIR", help="with --speculative: this head instead of the shipped one")
    q.add_argument(
        "--sizing",
        choices=("policy", "fixed"),
        default=None,
        help="with --speculative: policy (default), the load policy sizes each round's trees down to plain "
        "decoding by the measured forward cost (a whole tree at batch 48 costs more than it "
        "gains on a CPU); fixed: the head's whole trees every round",
    )
    g = q.add_argument_group('serving engine (docs/models-and-data.md "Regenerating through a server")')
    g.add_argument(
        "--server",
        nargs="+",
        default=None,
        metavar="URL",
        help="OpenAI-compatible chat-completions servers (vLLM, SGLang, llama-server) that serve the "
        "target, http://host:port; several share the work. --target then gives only the tokenizer",
    )
    g.add_argument("--model", default=None, help="the served model's name (default: the one model the servers list)")
    g.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="sent as a bearer token (default: $OPENAI_API_KEY)")
    g.add_argument("--concurrency", type=_positive_int, default=None, help="requests in flight per server (default 8)")
    g.add_argument(
        "--retries",
        type=_non_negative_int,
        default=None,
        help="tries again after a failed request (no connection, a timeout, a reply cut short, HTTP "
        + "/".join(map(str, RETRY_STATUS))
        + "), 1 s then doubling (default 4)",
    )
    g.add_argument("--request-timeout", type=float, default=None, help="seconds for one answer (default 600)")
    g.add_argument(
        "--reasoning",
        choices=("keep", "strip"),
        default=None,
        help="a reasoning text the server returns apart: keep it in the record (the token ids cover "
        "it) or strip it and keep the answer's text alone (default keep)",
    )

    q = sub.add_parser("capture", help="write the target features a run config needs to shards")
    q.add_argument("--config", required=True, help="run config (target, head, data) or preset name")
    q.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    q.add_argument("--out", default=None, help="shard folder (default: the config's features.path; a rerun keeps its complete shards)")
    add_overwrite_option(q)
    q.add_argument("--batch-size", type=_positive_int, default=None, help="default: the config's batch_size")
    add_device_option(q)  # the target's dtype and threads come from the config
    q.add_argument(
        "--backend",
        choices=("torch", "llama.cpp", "vllm"),
        default="torch",
        help="the target's forward: torch, or llama.cpp's through libllama on a GGUF of the target "
        "(`make llamacpp`; the layer inputs it returns are the hidden states; docs/llamacpp-backend.md), "
        "or vLLM's CPU build through its extract_hidden_states method, in a child process of "
        'vLLM\'s venv (docs/models-and-data.md "Capturing through vLLM")',
    )
    q.add_argument(
        "--vllm-venv",
        default=None,
        metavar="DIR",
        help="with --backend vllm: vLLM's venv (default: $DRAFTHEAD_VLLM_VENV, else .venv-interop/vllm "
        "in the checkout, as scripts/interop/setup_vllm.sh makes it)",
    )
    q.add_argument(
        "--vllm-kv-cache-gib",
        type=_positive_float,
        default=1.0,
        metavar="GIB",
        help="with --backend vllm: memory for vLLM's KV cache, which also holds the captured states "
        "until they are written (default 1: ~19k SmolLM2 fp32 tokens in flight)",
    )

    q = sub.add_parser("long-prompts", help="join whole chat turns into long multi-turn prompts (a JSONL file for bench)")
    source_options(q)
    q.add_argument("--target", default="smollm2-135m", help="whose tokenizer and chat template count the tokens")
    q.add_argument("--tokens", type=_positive_int, required=True, help="tokens per prompt, at most (more than 3/4 of it)")
    q.add_argument("--count", type=_positive_int, default=8, help="prompts to write")
    q.add_argument("--out", required=True, help="a new JSONL file of {id, messages}: `bench --dataset OUT` (an existing file is never replaced)")

    q = sub.add_parser("tiny-target", help="save a tiny random target + tokenizer and synthetic chats (smoke runs)")
    q.add_argument("--out", required=True, help="folder; the chats go to OUT/chats.jsonl")
    q.add_argument("--chats", type=_positive_int, default=200)
    q.add_argument(
        "--layers", type=_positive_int, default=None, help="decoder layers (default 4: the fewest whose EAGLE-3 heads every engine export takes)"
    )
    q.add_argument("--seed", type=int, default=0)
    add_overwrite_option(q)


def run(args) -> int:
    from ..train.capture.workshare import end_process_group

    if args.data_command == "regenerate":
        code = _regenerate_locked(args)
    else:
        code = {"inspect": _inspect, "capture": _capture, "tiny-target": _tiny, "long-prompts": _long_prompts}[args.data_command](args)

    end_process_group()
    return code


def _regenerate_locked(args) -> int:
    """`data regenerate` holding its output's lock, its --overwrite unable to delete its own
    source or a file it did not write, and a write error that names no file (a full disk) named
    as its --out."""
    from ..ground.outdir import check_replaceable, output_lock, reported_as
    from ..train.regeneration.regenerate import is_regenerated, part_files

    if args.overwrite:
        for path in [Path(args.out), *part_files(Path(args.out))]:
            check_replaceable(path, inputs=[args.path, args.target, args.head], what="output", own=is_regenerated)
    with output_lock(args.out, enabled=launch_rank() == 0), reported_as(args.out):  # the main process locks for all
        return _regenerate(args)


def _inspect(args) -> int:
    from ..train.data.sources import load_conversations

    ds, report = load_conversations(args.source, args.path, args.limit)
    print(report.summary())
    print(json.dumps(report.to_dict(), indent=1))
    return 0


def _work_share():
    """This process's part of the job: one of several under `accelerate launch` / `torchrun`, else alone."""
    from ..train.capture.workshare import detect_work_share

    return detect_work_share()


def _main_note(share):
    """`note` on the main process, silence on the others (docs/style.md 8: one process talks)."""
    return note if share.is_main else (lambda message: None)


def _rank_device(device: str | None, share) -> str:
    """--device for this process: under a launcher, a bare `cuda` is this process's own GPU."""
    device = resolve_device(device)
    if device == "cuda" and share.world > 1:
        return f"cuda:{os.environ.get('LOCAL_RANK', share.rank)}"
    return device


def _clear_for_overwrite(paths, share) -> None:
    """--overwrite of a resumable output: the main process deletes the old one before any process
    writes (ground/outdir.py clear_output)."""
    from ..ground.outdir import clear_output

    if share.is_main:
        for path in paths:
            clear_output(path)
    share.barrier()


# `data regenerate`'s options that only one way of answering reads: given with the other, refused
LOCAL_ONLY = ("batch_size", "speculative", "head", "sizing", "device", "threads", "round_weights")
SERVER_ONLY = ("model", "concurrency", "retries", "request_timeout", "reasoning")


def _regenerate(args) -> int:
    import dataclasses

    from ..ground.outdir import check_output
    from ..train.regeneration.regenerate import is_regenerated, part_files
    from ..train.data.sources import data_fingerprint, load_conversations

    share = _work_share()
    say = _main_note(share)
    out = Path(args.out)
    settings = _settings(args)  # checked here, before anything is read or cleared
    server = _server_settings(args, share)
    check_output(out, overwrite=args.overwrite, what="output", own=is_regenerated, hint=" and is not a `data regenerate` output to continue")
    _clear_for_overwrite([out, *part_files(out)] if args.overwrite else [], share)
    ds, source_report = load_conversations(args.source, args.path, args.limit)
    settings = dataclasses.replace(settings, data_sha256=data_fingerprint(args.source, args.path))  # a rerun must read the same data
    say(source_report.summary())
    with_images = sum(1 for row in ds["images"] if row)
    if with_images:
        raise ValueError(
            f"data regenerate answers text prompts; {with_images} conversations of {args.path or args.source} "
            "have images (not built): train on their own answers instead"
        )
    if server is not None:
        return _regenerate_from_servers(args, ds, out, settings, server)
    return _regenerate_locally(args, ds, out, share, say, settings)


def _settings(args):
    """RegenerateSettings of the options (checked as it is made); the target's name and the data's
    fingerprint are filled in once known."""
    from ..train.regeneration.regenerate import RegenerateSettings

    return RegenerateSettings(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        batch_size=args.batch_size if args.batch_size is not None else RegenerateSettings.batch_size,
        max_prompt_tokens=args.max_prompt_tokens,
        max_turns=args.max_turns,
        seed=args.seed,
    )


def _server_settings(args, share):
    """ServerSettings of the --server options (checked as it is made), None without --server; an
    option of the other way of answering is refused (LOCAL_ONLY, SERVER_ONLY)."""
    from ..train.regeneration.openai_client import ServerSettings

    def flag(name: str) -> str:
        return "--" + name.replace("_", "-")

    if not args.server:
        given = [flag(name) for name in SERVER_ONLY if getattr(args, name) is not None]
        if given:
            raise ValueError(f"{given[0]} is a setting of --server: pass --server URL, or drop {given[0]}")
        return None
    given = [flag(name) for name in LOCAL_ONLY if getattr(args, name) not in (None, False)]
    if given:
        raise ValueError(
            f"{given[0]} sets how our engine answers, but --server answers through the servers: drop {given[0]} "
            "(--concurrency sets the requests in flight per server)"
        )
    if share.world > 1:
        raise ValueError("--server runs as one process: more servers or --concurrency share the work")
    options = {name: getattr(args, name) for name in SERVER_ONLY if getattr(args, name) is not None}
    return ServerSettings(urls=tuple(args.server), api_key=args.api_key, **options)


def _check_written(report, out: Path) -> None:
    """A run that wrote no record and found none: exit 2, the empty file removed."""
    from ..ground.outdir import clear_output, is_empty

    if report.already_done + report.written == 0:
        if is_empty(out):
            clear_output(out)  # the file opened for appending, with nothing in it
        raise ValueError(
            f"{out}: no record written ({report.summary()}): the target answered no turn; check the target, its chat template and --max-new-tokens"
        )


def _regenerate_from_servers(args, ds, out: Path, settings, server) -> int:
    import dataclasses
    import time

    from ..ground.target.load import load_tokenizer
    from ..train.regeneration.from_servers import regenerate_from_servers

    tokenizer, name = load_tokenizer(args.target)
    start = time.perf_counter()
    report, model = regenerate_from_servers(tokenizer, ds, out, dataclasses.replace(settings, target_name=name), server)
    seconds = time.perf_counter() - start
    _check_written(report, out)
    print(f"{out}: {report.summary()}")
    print(
        f"served by {model} on {len(server.urls)} server(s): {report.answer_tokens} answer tokens in {seconds:.1f} s "
        f"({report.answer_tokens / max(seconds, 1e-9):.1f} tokens/s)"
    )
    if report.answers_without_ids:
        print(f"{report.answers_without_ids} answers came without token ids: stored as text, re-tokenized in training")
    if report.prompt_tokens_differ:
        print(
            f"{report.prompt_tokens_differ} prompts were counted otherwise by the server than by {name}'s chat "
            "template and tokenizer: check that it serves the same template"
        )
    return 0


def _regenerate_locally(args, ds, out: Path, share, say, settings) -> int:
    import dataclasses

    from ..train.regeneration.regenerate import regenerate

    args.device = _rank_device(args.device, share)
    loaded = load_target_from_args(args)
    model, drafter, sizing = loaded.model, None, "fixed"
    if args.speculative or args.head:
        from ..draft_spec import DraftSpec

        spec = DraftSpec(proposer="head", head=args.head, sizing=args.sizing or "policy")
        drafting = spec.build(loaded, threads=args.threads, note=say)
        drafter, model, sizing = drafting.factory(), drafting.model, drafting.sizing
        say(
            f"answering through speculative decoding with the head at {drafting.spec.head}"
            + (", trees sized by the load policy" if sizing == "policy" else ", whole trees")
        )
    settings = dataclasses.replace(settings, target_name=loaded.name)
    report = regenerate(model, loaded.tokenizer, ds, args.out, settings, drafter=drafter, sizing=sizing, share=share)
    if share.is_main:
        _check_written(report, out)
    elif report.already_done + report.written == 0:
        raise ValueError(f"{out}: no record written")
    if share.is_main:
        print(f"{args.out}: {report.summary()}")
    return 0


def _capture(args) -> int:
    from tqdm.auto import tqdm

    from ..ground.files import read_json
    from ..ground.outdir import check_output, check_replaceable, output_lock
    from ..ground.target.load import load_target
    from ..train.loop.config import load_config
    from ..train.capture.features import CAPTURE_PLAN
    from ..train.loop.run import capture_from_config, stale_capture

    config = load_config(args.config, args.overrides)  # the head section too: checked before the target loads
    out = args.out or config.features.path
    if not out:
        raise ValueError("pass --out DIR or set features.path in the config")
    check_output(
        out, overwrite=args.overwrite, what="capture folder", own=lambda p: (p / CAPTURE_PLAN).exists(), hint=" and holds no capture to continue"
    )
    if args.overwrite:
        check_replaceable(out, inputs=[config.data.path, config.target, config.init_from, args.config], what="capture folder")
    elif (Path(out) / CAPTURE_PLAN).exists():  # a rerun continues it: only if made from the same data
        changed = stale_capture(read_json(Path(out) / CAPTURE_PLAN).get("meta", {}), config)
        if changed:
            raise ValueError(
                f"{out} holds a capture made from other data ({'; '.join(changed)}): pass --overwrite "
                "to capture again from scratch, or use another --out"
            )
    device = backend_device(args.device, args.backend)
    require_backend(args.backend)
    share = _work_share()
    with output_lock(out, enabled=share.is_main):
        _clear_for_overwrite([Path(out)] if args.overwrite else [], share)
        loaded = load_target(config.target, dtype=config.target_dtype, device=_rank_device(device, share), threads=config.threads)
        engine = llamacpp_target(loaded, None, config.threads, note) if args.backend == "llama.cpp" else None
        with _vllm_engine(args, loaded, config) as vllm:
            bar = tqdm(desc="capture", unit="sample", dynamic_ncols=True, disable=not share.is_main)
            try:
                index = capture_from_config(
                    config,
                    loaded.model,
                    loaded.tokenizer,
                    out,
                    target_name=loaded.name,
                    batch_size=args.batch_size,
                    progress=bar.update,
                    say=_main_note(share),
                    share=share,
                    engine=engine or vllm,
                )
            finally:
                bar.close()
    if share.is_main:
        print(f"captured features: {index}; train with features.mode=captured features.path={out}")
    return 0


@contextlib.contextmanager
def _vllm_engine(args, loaded, config):
    """--backend vllm: a VllmTarget for the capture, its child ended after it, and its work folder
    (spec, vLLM's log and files) removed unless the capture failed; None for the other backends."""
    if args.backend != "vllm":
        yield None
        return
    import shutil

    from ..inference.vllm.capture import VllmTarget
    from . import torch_threads

    dtype = str(next(loaded.model.parameters()).dtype).removeprefix("torch.")
    with VllmTarget(
        loaded.path,
        loaded.model,
        dtype=dtype,
        max_length=config.data.max_length,
        venv=args.vllm_venv,
        threads=config.threads or torch_threads(),
        kv_cache_bytes=int(args.vllm_kv_cache_gib * (1 << 30)),
    ) as engine:
        note(f"vLLM backend: the target through vLLM's extract_hidden_states, {dtype}; its log: {engine.log}")
        yield engine
    shutil.rmtree(engine.work, ignore_errors=True)


def _long_prompts(args) -> int:
    from ..ground.files import atomic_write
    from ..ground.outdir import output_lock
    from ..ground.target.load import load_tokenizer, target_context
    from ..inference.bench.long_prompts import long_chats
    from ..train.data.sources import iter_conversations, resolve_source, source_format
    from ..train.data.source_report import SourceReport

    out = Path(args.out)

    def refuse_existing():
        if out.exists():  # it may be someone's prompt set: never replaced, even empty (no --overwrite)
            raise FileExistsError(
                f"{out} exists, and long-prompts never replaces a file (it takes no --overwrite): remove it or write somewhere else"
            )

    refuse_existing()  # at the start, before the tokenizer and the data are read
    context = target_context(args.target)
    if context is not None and args.tokens >= context:  # the engine refuses a prompt that fills the context
        raise ValueError(
            f"--tokens {args.tokens}: {args.target}'s context holds {context} tokens, and a prompt must leave room for "
            f"the answer: use --tokens below {context}, less the tokens to generate"
        )
    tokenizer, _ = load_tokenizer(args.target)
    file = resolve_source(args.source, args.path)
    report = SourceReport(source=args.source)
    prompts = long_chats(iter_conversations(file, source_format(args.source, file), report, args.limit), tokenizer, args.tokens, args.count)

    def write(tmp):
        with open(tmp, "w", encoding="utf-8") as f:
            for prompt in prompts:
                f.write(json.dumps(prompt, ensure_ascii=False) + "\n")

    with output_lock(out):  # a second copy writing the same file at once is refused, not raced
        refuse_existing()  # one that finished meanwhile is kept
        atomic_write(out, write)
    print(f"{len(prompts)} prompts of at most {args.tokens} tokens in {out}, from {report.conversations} conversations")
    return 0


def _tiny(args) -> int:
    from ..train.data.tiny import CHATS_FILE, save_tiny_target

    layers = {} if args.layers is None else {"num_layers": args.layers}
    folder = save_tiny_target(args.out, seed=args.seed, chats=args.chats, overwrite=args.overwrite, **layers)
    print(f"tiny target in {folder}, {args.chats} chats in {folder / CHATS_FILE}")
    return 0
