"""`drafthead generate`: answer one prompt with speculative decoding, streaming the text."""

from __future__ import annotations

import sys
from pathlib import Path

from . import (
    draft_spec_from_args,
    drafting_from_args,
    add_proposer_options,
    add_sampling_options,
    add_target_options,
    add_typical_option,
    load_target_from_args,
    note,
    engine_options,
    sampling_from_args,
    typical_from_args,
)


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("generate", help="answer one prompt with speculative decoding (streams the text)")
    p.add_argument("--prompt", required=True, help="the user message (the chat template is applied)")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop string (repeatable)")
    p.add_argument(
        "--image",
        action="append",
        default=[],
        metavar="PATH",
        help="an image before the prompt's text, for a vision-language target folder (repeatable; its processor renders them)",
    )
    add_target_options(p)
    add_proposer_options(p)
    add_sampling_options(p)
    add_typical_option(p)


class TextPrinter:
    """`on_tokens` callback: decode the whole answer so far and print what is new.

    Decoding the full list (not token by token) keeps multi-token characters and merged spaces
    right; text ending in U+FFFD is an incomplete UTF-8 sequence, held back until it completes.
    """

    def __init__(self, tokenizer, stream=None):
        self.tokenizer = tokenizer
        self.stream = stream or sys.stdout  # looked up now, not at import (tests swap sys.stdout)
        self.ids: list[int] = []
        self.printed = 0

    def __call__(self, tokens: list[int]) -> None:
        self.ids.extend(tokens)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return
        self.stream.write(text[self.printed :])
        self.stream.flush()
        self.printed = len(text)

    def finish(self) -> None:
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        self.stream.write(text[self.printed :] + "\n")
        self.stream.flush()


def run(args) -> int:
    import time

    from ..inference.engine.generate import GenerationConfig, speculative_generate
    from ..inference.bench.prompts import Prompt, PromptError, encode_chat
    from ..inference.engine.stopping import check_stop_strings
    from ..ground.target.identity import eos_token_ids

    if not args.prompt.strip():
        raise PromptError("the prompt is empty")
    missing = [p for p in args.image if not Path(p).is_file()]
    if missing:
        raise FileNotFoundError(f"no image file at {missing[0]}")
    if args.image:  # each decoded now: one cut short is named before any model loads
        from ..train.data.image_chats import open_images

        open_images(args.image)
    check_stop_strings(args.stop)
    spec = draft_spec_from_args(args)
    sampling = sampling_from_args(args)
    loaded = load_target_from_args(args)
    drafting = drafting_from_args(args, spec, loaded, sampling)
    note(drafting.message)  # once the drafter is built: a head that cannot draft is the only line
    drafter, tokenizer, model, verifier = drafting.factory(), loaded.tokenizer, drafting.model, drafting.verifier
    device = next(model.parameters()).device
    images = None
    if args.image:
        from ..train.data.image_chats import encode_image_prompt, load_processor

        input_ids, images = encode_image_prompt(load_processor(str(loaded.path)), args.prompt, args.image)
        input_ids = input_ids.to(device)
    else:
        input_ids = encode_chat(tokenizer, Prompt(text=args.prompt)).to(device)
    config = GenerationConfig(
        max_new_tokens=args.max_new_tokens,
        sampling=sampling,
        eos_token_ids=eos_token_ids(model, tokenizer),
        stop_strings=tuple(args.stop),
        seed=args.seed,
        typical=typical_from_args(args),
        sizing=drafting.sizing,
        **engine_options(args),
    )
    if config.lossy:
        note("LOSSY: typical acceptance is on; the output is not distributed as the target's")
    printer = TextPrinter(tokenizer)
    start = time.perf_counter()
    result = speculative_generate(verifier, drafter, input_ids, config, images=images, tokenizer=tokenizer, on_tokens=printer)
    seconds = time.perf_counter() - start
    printer.finish()
    n = result.new_tokens.shape[1]
    note(f"tau {result.tau:.2f} ({n} tokens in {result.num_rounds} target forwards), {n / seconds:.1f} tokens/s, finish: {result.finish_reason}")
    return 0
