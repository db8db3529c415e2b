"""Building a drafter by name: the one place that maps `--proposer` to a Drafter.

    prompt-lookup  n-gram lookup in the sequence so far (no model, no training)
    draft-model    a small causal LM sharing the target's vocabulary
    head           a trained head folder (`drafthead train` writes one)
    none           no drafts: plain decoding in our engine (the reference a server or bench compares with)

Drafter modules are imported lazily inside each branch, so `import drafthead` stays light and a
proposer whose module is broken or absent only fails when asked for.
"""

from __future__ import annotations

import importlib.resources
import sys
from pathlib import Path
from typing import Callable


PROPOSERS = ("prompt-lookup", "draft-model", "head", "none")


# Strings whose ids must agree between a target and a draft model's tokenizers (besides the
# whole-vocabulary checks): words, code, numbers, whitespace, non-Latin text and chat markup.
_VOCAB_PROBES = [
    "The quick brown fox jumps over the lazy dog.",
    "def main(argv):\n    return 0\n",
    "3.14159 + 2 = 5.14159; 1,000,000",
    "   leading and trailing spaces   ",
    "Übergrößenträger, naïve café, 東京, Москва, 🙂",
    "<|im_start|>user\nhello<|im_end|>\n",
]


class DrafterError(ValueError):
    """A drafter that cannot be built as asked (unknown proposer, incompatible draft model...)."""


def build_drafter(
    proposer: str,
    target,
    tokenizer,
    *,
    head: str | Path | None = None,
    draft_model=None,
    num_draft: int | None = None,  # draft nodes per round (None: the proposer's default)
    **kw,
):
    """A fresh drafter for `target` (the model). Extra keywords go to the drafter's constructor
    (e.g. max_ngram for prompt lookup, sampling/seed/choices for a draft model).

    draft_model: a name or path (loaded with load_target in the target's dtype and device), a
    LoadedTarget, or an already loaded model (then pass `draft_tokenizer=` to check the vocabulary).
    Heads are loaded from `head`; the head loader may adapt the target in place (Medusa-2's merged
    LoRA): the adapted model is then the target whose output the decode reproduces.
    """
    if kw.get("sizing", "fixed") != "fixed" and proposer != "head":
        raise DrafterError(f"sizing {kw['sizing']!r} sizes EAGLE trees and DSpark blocks, not {proposer} drafts")
    if proposer == "none":
        from .inference.engine.drafter import RootOnlyDrafter

        if num_draft is not None or kw:
            raise DrafterError(f"proposer 'none' drafts nothing: it takes no {'num_draft' if num_draft is not None else next(iter(kw))}")
        return RootOnlyDrafter()
    if proposer == "prompt-lookup":
        from .inference.drafters.prompt_lookup import PromptLookupDrafter

        # streak 32: measured ahead of no streak on MT-bench (docs/results.md)
        defaults = {"max_ngram": 3, "min_ngram": 1, "streak_draft": 32}
        return PromptLookupDrafter(**{**defaults, "num_draft": num_draft, **kw})
    if proposer == "draft-model":
        from .inference.drafters.draft_model import DraftModelDrafter

        if draft_model is None:
            raise DrafterError("the draft-model proposer needs a draft model (--draft-model NAME)")
        draft_tokenizer = kw.pop("draft_tokenizer", None)
        model = _draft_model(draft_model, target, tokenizer, draft_tokenizer)
        from .inference.engine.sampling import SamplingConfig

        sampling = kw.pop("sampling", None) or SamplingConfig()
        return DraftModelDrafter(model, num_draft=4 if num_draft is None else num_draft, sampling=sampling, **kw)
    if proposer == "head":
        drafter, adapted = head_folder_drafter(head, target, tokenizer, num_draft=num_draft, **kw)
        if adapted is not target:
            raise DrafterError(
                "this head adapts the target (Medusa-2 LoRA): use make_drafter_factory, which returns the adapted target to decode with"
            )
        return drafter
    raise DrafterError(f"unknown proposer '{proposer}': use one of {', '.join(PROPOSERS)}")


def make_drafter_factory(proposer: str, target, tokenizer, **kw) -> tuple[Callable[[], object], object]:
    """(factory, target): the factory gives a drafter with fresh state for each prompt (what the
    benchmark needs); target is the model to decode with (a Medusa-2 head returns the target
    with its LoRA merged, and plain and speculative runs must both use that one).

    Expensive parts are built once: a draft model is loaded once and shared; a head drafter is
    built once and reused, since `begin()` starts its state afresh for every sequence.
    """
    if proposer == "head":
        drafter, target = head_folder_drafter(kw.pop("head", None), target, tokenizer, **kw)
        return (lambda: drafter), target
    if proposer == "draft-model" and kw.get("draft_model") is not None:
        loaded = _draft_model(kw.pop("draft_model"), target, tokenizer, kw.pop("draft_tokenizer", None))
        return (lambda: build_drafter(proposer, target, tokenizer, draft_model=loaded, **kw)), target
    build_drafter(proposer, target, tokenizer, **kw)  # fail now, before any generation, if it cannot
    return (lambda: build_drafter(proposer, target, tokenizer, **kw)), target


def head_folder_drafter(
    head, target, tokenizer, *, num_draft: int | None = None, sizing: str | None = None, target_name: str | None = None, **options
):
    """(drafter, target) for a trained head folder; `num_draft` sets the draft nodes per round,
    `sizing` "confidence" lets an EAGLE or DSpark head size each round itself (None: drafting.json's)."""
    if head is None:
        raise DrafterError("the head proposer needs a trained head folder (--head DIR)")
    head = Path(head)
    if not head.is_dir():
        raise FileNotFoundError(f"no head folder at {head}")
    from .heads.formats.common import ConventionNeeded
    from .heads.config import check_sizing
    from .inference.drafters.load import load_head_drafter

    layout, kind = head_layout(head)
    if num_draft is not None or sizing is not None:
        try:  # before the head loads
            check_sizing(str(kind), sizing)
        except ValueError as e:
            raise DrafterError(f"{head}: {e}") from None
        options.update(num_draft=num_draft, sizing=sizing)
    if layout == "ours":
        return load_head_drafter(head, target, tokenizer, target_name=target_name, **options)
    try:
        loaded = load_head_drafter(head, target, tokenizer, target_name=target_name, **options)
    except ConventionNeeded as e:  # --head has no --convention: the import command does
        raise ConventionNeeded(f"{e}. Convert it once with `drafthead import {head} --convention ... --out DIR` and pass --head DIR") from e
    print(
        f"drafthead: {head} is a {layout} checkpoint, read exactly into a {kind} head (`drafthead import` saves it as a drafthead head folder)",
        file=sys.stderr,
    )
    return loaded


def head_layout(head: Path) -> tuple[str, str | None]:
    """(layout, head kind) of the head folder `head`, ours or a foreign one, from its files alone."""
    from .heads.formats import detect_layout, layout_kind
    from .heads.io import CONFIG_NAME
    from .ground.files import read_json

    layout = detect_layout(head)
    if layout == "ours":
        return layout, read_json(Path(head) / CONFIG_NAME).get("config", {}).get("kind")
    return layout, layout_kind(head, layout)


def default_head_path(target_name: str) -> Path | None:
    """The head shipped for a target (`heads/pretrained/<target-name>/`, package data of
    drafthead.heads.pretrained), when one with a config.json is there; else None."""
    try:
        root = importlib.resources.files("drafthead.heads.pretrained")
    except ModuleNotFoundError:
        return None
    folder = Path(str(root)) / target_name
    return folder if (folder / "config.json").is_file() else None


# ---------------------------------------------------------------------------------------------
# Draft models
# ---------------------------------------------------------------------------------------------


def _draft_model(draft_model, target, tokenizer, draft_tokenizer=None):
    """Resolve `draft_model` to a model on the target's device and dtype sharing its vocabulary."""
    from .ground.target.load import LoadedTarget, load_target

    param = next(target.parameters())
    if isinstance(draft_model, (str, Path)):
        draft_model = load_target(draft_model, dtype=param.dtype, device=param.device)
    if isinstance(draft_model, LoadedTarget):
        draft_tokenizer = draft_model.tokenizer
        draft_model = draft_model.model
    check_same_vocabulary(target, tokenizer, draft_model, draft_tokenizer)
    return draft_model


def check_same_vocabulary(target, tokenizer, draft, draft_tokenizer=None) -> None:
    """Raise DrafterError unless the draft model can propose target token ids: the same vocab
    size and, when its tokenizer is known, the same ids for the whole vocabulary and for sample
    strings (so the two tokenizers also split text the same way)."""
    t_vocab = _vocab_size(target)
    d_vocab = _vocab_size(draft)
    if t_vocab != d_vocab:
        raise DrafterError(f"draft model vocabulary ({d_vocab}) differs from the target's ({t_vocab})")
    if draft_tokenizer is None:
        return
    if len(tokenizer) != len(draft_tokenizer):
        raise DrafterError(f"draft tokenizer has {len(draft_tokenizer)} tokens, the target's {len(tokenizer)}")
    t_map, d_map = tokenizer.get_vocab(), draft_tokenizer.get_vocab()
    if t_map != d_map:
        differing = sorted(k for k in t_map.keys() | d_map.keys() if t_map.get(k) != d_map.get(k))
        raise DrafterError(f"draft and target tokenizers map {len(differing)} tokens differently (e.g. {differing[:3]})")
    # A few hundred strings through each tokenizer's full pipeline (normaliser, pre-tokenizer, merges)
    probes = _VOCAB_PROBES + [tokenizer.decode([i]) for i in range(0, len(tokenizer), max(1, len(tokenizer) // 300))]
    for text in probes:
        a = tokenizer(text, add_special_tokens=False).input_ids
        b = draft_tokenizer(text, add_special_tokens=False).input_ids
        if a != b:
            raise DrafterError(f"draft and target tokenizers encode {text[:40]!r} differently: {a[:8]} vs {b[:8]}")


def _vocab_size(model) -> int:
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return int(config.vocab_size)
