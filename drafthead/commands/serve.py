"""`drafthead serve`: an OpenAI-compatible server on the exact engine (docs/serving.md).

The port is bound first, so a port in use fails at once; /health answers 503 while the target
loads and 200 once it serves. SIGTERM or Ctrl-C: no new connection or request is taken, the
answers in flight get --shutdown-grace seconds to finish (then are cancelled), and the process
exits 0.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

from . import (
    _positive_int,
    add_proposer_options,
    add_target_options,
    draft_spec_from_args,
    drafting_from_args,
    load_target_from_args,
    note,
)
from ..train.adapt.worker import PRIORITIES

DEFAULT_PORT = 8000
DEFAULT_ROW_CELLS = 4096  # llama.cpp backend: KV cells a request may hold by default (--kv-cells)


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("serve", help="an OpenAI-compatible server (chat and completions, streamed or whole) on the exact engine")
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    g.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT}; 0: any free one, printed)")
    g.add_argument("--max-batch", type=_positive_int, default=16, help="requests decoding together (default 16)")
    g.add_argument("--max-queue", type=_positive_int, default=256, help="requests waiting beyond the batch; more get 429 (default 256)")
    g.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` on /v1 (default: none)")
    g.add_argument("--served-model-name", default=None, help="the model name clients ask for (default: the target's name)")
    g.add_argument("--context", type=_positive_int, default=None, help="tokens per request, prompt and answer (default: the target's context)")
    g.add_argument(
        "--kv-cells",
        type=_positive_int,
        default=None,
        help="llama.cpp backend: KV cells shared by the batch; a request reserves prompt + max_tokens + a tree's room "
        "and waits while they are taken (default: max-batch x (min(context, 4096) + 256); a request's context is what its share holds)",
    )
    g.add_argument(
        "--kv-layout",
        choices=("streams", "unified"),
        default="streams",
        help="llama.cpp backend: streams (default): a KV stream per request, attending to its own text only, trees cut to "
        "chains; unified: one cache for all, where trees keep their branches (docs/llamacpp-backend.md)",
    )
    g.add_argument(
        "--traffic-log",
        default=None,
        metavar="FILE",
        help="append every answered request and its reply to FILE, a JSON line each (`gate`, `train` read it)",
    )
    g.add_argument("--shutdown-grace", type=float, default=25.0, help="seconds the answers in flight get to finish after SIGTERM (default 25)")
    g = p.add_argument_group('adapting to the traffic (docs/serving.md "Adapting to the traffic")')
    g.add_argument("--adapt", default=None, metavar="DIR", help="the served head fine-tunes on what it serves, behind a gate; its versions in DIR")
    g.add_argument("--adapt-threads", type=_positive_int, default=1, help="torch threads of the background trainer (default 1)")
    g.add_argument(
        "--adapt-priority",
        choices=PRIORITIES,
        default="idle",
        help="the trainer's CPU priority: idle (default; only cycles serving leaves, Linux SCHED_IDLE) or low (nice 10, a small share under load)",
    )
    g.add_argument("--adapt-min-tokens", type=_positive_int, default=2000, help="new answer tokens between training rounds (default 2000)")
    g.add_argument("--adapt-steps", type=_positive_int, default=60, help="optimizer steps a round (default 60)")
    g.add_argument("--adapt-lr", type=float, default=1e-4, help="learning rate (default 1e-4)")
    g.add_argument(
        "--adapt-margin", type=float, default=0.02, help="the relative tau gain a candidate must show, and a swap lose to roll back (0.02)"
    )
    g.add_argument("--adapt-holdout", type=_positive_int, default=16, help="newest answers the gate replays on (default 16)")
    g.add_argument("--adapt-window", type=_positive_int, default=400, help="rounds of a new head's requests before the rollback check (400)")
    g.add_argument("--adapt-buffer-tokens", type=_positive_int, default=200_000, help="answer and prompt tokens the buffer keeps (200000)")
    add_target_options(p)
    add_proposer_options(p)


def run(args) -> int:
    code = serve(args)
    # Everything is closed and written. The process ends here rather than in the interpreter's
    # teardown, where a daemon thread (an HTTP handler, the shutdown watcher) still releasing a
    # tensor is stopped inside torch's C++ and aborts the process (exit -6 after a clean stop).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def serve(args) -> int:
    from ..inference.engine.backend import target_backend
    from ..ground.target.load import context_limit
    from ..inference.serve.engine import TREE_ROOM, EngineSettings, ServingEngine
    from ..inference.serve.http import DraftheadServer

    if args.static_cache or args.compile:
        raise ValueError("serve batches continuously, which needs the dynamic cache: drop --static-cache / --compile")
    if not 0 <= args.port < 65536:
        raise ValueError(f"--port must be between 0 and 65535, got {args.port}")
    if not 0 <= args.shutdown_grace < float("inf"):
        raise ValueError(f"--shutdown-grace must be a number of seconds >= 0, got {args.shutdown_grace}")
    spec = draft_spec_from_args(args)
    adaptation = None
    if args.adapt and spec.proposer not in (None, "head"):
        raise ValueError(f"--adapt fine-tunes a trained head; --proposer {spec.proposer} has none to train")
    server = DraftheadServer((args.host, args.port), api_key=args.api_key, traffic_log=args.traffic_log)  # bind first: a port in use fails now
    host, port = server.server_address[:2]
    url = f"http://{host!s}:{port}"
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.serve_in_background()
        note(f"serve: listening on {url} (/health answers 200 once the target is loaded)")
        loaded = load_target_from_args(args)
        drafting = drafting_from_args(args, spec, loaded)
        note(drafting.message)
        trained = context_limit(drafting.model.config)
        if args.context and trained and args.context > trained:
            raise ValueError(f"--context {args.context} is longer than the target's {trained}")
        context = args.context or trained
        backend = target_backend(drafting.verifier, row_invariant=args.row_invariant)  # settled by drafting_from_args
        kv_cells = None
        streams = args.kv_layout == "streams"
        if args.backend == "llama.cpp":
            kv_cells = args.kv_cells or args.max_batch * (min(context or DEFAULT_ROW_CELLS, DEFAULT_ROW_CELLS) + TREE_ROOM)
            # a request holds its prompt, answer and one round's tree: in its stream, or in the shared cache
            room = (kv_cells // args.max_batch if streams else kv_cells) - TREE_ROOM
            if room < 2:
                raise ValueError(f"--kv-cells {kv_cells} leaves no room for a request beside a tree's {TREE_ROOM} cells")
            context = min(context or room, room)
        elif args.kv_cells:
            raise ValueError("--kv-cells sizes the llama.cpp backend's cache; the torch backend's grows as rows join")
        model, decode_all = served_model(loaded, args.served_model_name or loaded.name, context)
        template = drafting.factory()
        head = served_head(template, drafting.spec) if args.adapt else None
        record_layers = adapting_layers(head, loaded) if head is not None else ()
        engine = ServingEngine(
            backend,
            template,
            EngineSettings(max_batch=args.max_batch, max_queue=args.max_queue, max_len=context, kv_cells=kv_cells, streams=streams),
            eos_token_ids=eos_ids(drafting.model, loaded.tokenizer),
            decode=decode_all,
            sizing=drafting.sizing,
            metrics=server.metrics,
            record_layers=record_layers,
        )
        adaptation = start_adapting(args, engine, loaded, head, drafting) if head is not None else None
        server.ready(model, engine)

        def shut_down() -> None:  # SIGTERM or Ctrl-C set `stop`; the engine's loop ends here
            stop.wait()
            note("serve: stopping: no new requests; finishing the ones in flight")
            server.close_door()
            engine.stop(args.shutdown_grace)

        threading.Thread(target=shut_down, name="drafthead-shutdown", daemon=True).start()
        note(f"serve: {model.name} on {url}/v1 (max batch {args.max_batch}, context {context})")
        engine.run()  # on this thread, which loaded the target (ServingEngine.run)
        if engine.failure is not None:  # its traceback is above; the requests in flight were told
            note(f"drafthead: error: the serving engine stopped: {engine.failure}")
            return 1
        server.wait_answered(5.0)
        if adaptation is not None:
            adaptation.stop()
        note("serve: stopped")
        return 0
    finally:
        if not server.stopping:
            server.close_door()
        server.server_close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def eos_ids(model, tokenizer) -> tuple[int, ...]:
    from ..ground.target.identity import eos_token_ids

    return eos_token_ids(model, tokenizer)


def served_model(loaded, name: str, context: int | None):
    """(the ServedModel the HTTP side reads, ids -> text with special tokens for the stop strings):
    the tokenizer behind one lock, since the HTTP threads and the engine thread share it."""
    from ..inference.bench.prompts import Prompt, encode_chat
    from ..inference.serve.http import ServedModel

    tokenizer = loaded.tokenizer
    lock = threading.Lock()

    def render_chat(messages: list[dict]) -> list[int]:
        with lock:
            return encode_chat(tokenizer, Prompt(text=messages[-1]["content"], messages=tuple(messages)))[0].tolist()

    def encode(text: str) -> list[int]:
        with lock:
            return tokenizer(text).input_ids

    def decode(ids: list[int], skip_special_tokens: bool = True) -> str:
        with lock:
            return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_text(token: int) -> str:
        return decode([token], skip_special_tokens=False)

    return ServedModel(name, context, render_chat, encode, decode, token_text), (lambda ids: decode(ids, skip_special_tokens=False))


def served_head(drafter, spec):
    """The head module the drafter drafts with (inside a merged drafter too); refused in one line
    for a kind that cannot adapt on recorded features."""
    from ..heads.config import head_kind
    from ..heads.io import DraftHeadBase

    found, todo = None, [drafter]
    while todo and found is None:
        item = todo.pop(0)
        if isinstance(item, DraftHeadBase):
            found = item
        elif isinstance(item, (list, tuple)):
            todo += list(item)
        elif hasattr(item, "__dict__") and not isinstance(item, type):
            todo += [v for v in vars(item).values() if isinstance(v, (DraftHeadBase, list, tuple)) or hasattr(v, "propose")]
    if found is None:
        raise ValueError(f"--adapt: the drafter of {spec.head} holds no trained head to fine-tune")
    if head_kind(found.kind).adapts_target:
        raise ValueError(f"--adapt: a {found.kind} head trains the target with it (its LoRA), which recorded features cannot")
    return found


def adapting_layers(head, loaded) -> tuple[int, ...]:
    from ..train.capture.features import required_layers

    from ..ground.target.identity import text_config

    return required_layers(head.config, text_config(loaded.model).num_hidden_layers)


def start_adapting(args, engine, loaded, head, drafting):
    from pathlib import Path

    from ..train.adapt.live import Adaptation, BufferCaps
    from ..train.adapt.worker import AdaptSettings

    settings = AdaptSettings(
        target=args.target,
        target_dtype="float32",
        target_name=loaded.name,
        drafting=drafting.head_drafting.to_dict(),
        threads=args.adapt_threads,
        priority=args.adapt_priority,
        min_new_tokens=args.adapt_min_tokens,
        holdout=args.adapt_holdout,
        steps=args.adapt_steps,
        lr=args.adapt_lr,
        margin=args.adapt_margin,
    )
    adaptation = Adaptation(
        Path(args.adapt),
        engine,
        loaded,
        head,
        Path(drafting.spec.head),
        settings,
        window=args.adapt_window,
        caps=BufferCaps(max_tokens=args.adapt_buffer_tokens),
    )
    adaptation.start()
    note(f"serve: adapting the head in {args.adapt} (version {adaptation.version} live)")
    return adaptation
