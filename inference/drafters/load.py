"""A head folder -> its drafter: the head loaded (our layout) or imported (a published one), then
wrapped in the drafter of its family with the folder's drafting settings (drafting.json)."""

from __future__ import annotations

from pathlib import Path

from ...heads.formats import detect_layout, import_head
from ...heads.config import check_sizing, head_kind, resolve
from ...heads.registry import load_head
from ..engine.cost import measure_verify_cost
from ..kernels.target_linears import dispatch_linears
from .head_drafters import check_drafting_keys, check_drafting_values, drafting_defaults
from .merged import MergedDrafter
from .prompt_lookup import PromptLookupDrafter


def head_drafter(head, **settings):
    """`head` in the drafter its KINDS row names, built with `settings` (that drafter's options).
    The head is used as it is: no eval(), no linear dispatch, so a head still training can be
    replayed."""
    return resolve(head_kind(head.kind).drafter)(head, **settings)


def chain_settings(kind: str, k: int) -> dict:
    """Drafter settings for a chain of k top-1 drafts, in the terms of `kind`'s drafter family."""
    if head_kind(kind).grows_tree:
        return {"num_draft": k, "depth": k, "top_k": 1}
    return {"choices": [[0] * d for d in range(1, k + 1)]}


def load_head_drafter(path, target_model, tokenizer, target_name: str | None = None, **options):
    """Load a head folder for `target_model` and wrap it in the matching drafter.

    Options override the folder's `drafting.json`. chain=k drafts a chain of k top-1 drafts a
    round instead of the head's tree (`chain_settings`: what vLLM and SGLang serve). lookup_nodes > 0 merges that many
    prompt-lookup nodes into every tree (MergedDrafter): n-gram continuations catch the text a
    model repeats, where a head is least sure; lookup_streak > lookup_nodes lets a continuation
    that was wholly accepted come back that long next round (PromptLookupDrafter.streak_draft).
    Returns (drafter, target): a Medusa-2 head carries a LoRA adapter merged into the target,
    and that adapted target is the one whose output the speculative path reproduces.
    """
    if detect_layout(path) == "ours":
        head, target = load_head(Path(path), target_model, tokenizer, target_name=target_name)
    else:  # a published layout (vLLM, speculators, upstream EAGLE/Medusa...), read exactly or refused
        head, target = import_head(path, target_model, tokenizer, target_name=target_name), target_model
    head.eval()
    dispatch_linears(head)  # draft steps multiply a few rows by every head weight (inference/kernels/target_linears.py)
    drafter_class = resolve(head_kind(head.kind).drafter).__name__
    given = {k: v for k, v in options.items() if v is not None}  # None: keep drafting.json's value
    chain = given.pop("chain", None)
    check_drafting_keys(given, drafter_class, f"{head.kind} drafter options")
    check_drafting_values(given, f"{head.kind} drafter options")
    settings = {**drafting_defaults(Path(path), drafter_class), **given}
    if chain is not None:  # the chain replaces the tree drafting.json describes, and sizes nothing itself
        for key in ("choices", "num_draft", "depth", "top_k", "sizing"):
            settings.pop(key, None)
        settings.update(chain_settings(head.kind, chain))
    lookup_nodes = settings.pop("lookup_nodes", 0)
    lookup_streak = settings.pop("lookup_streak", None)
    sizing = settings.pop("sizing", "fixed")
    check_sizing(head.kind, sizing)
    if sizing == "confidence":
        # the verifier returns hidden states to these drafters, so time the forward that way
        settings.update(sizing="confidence", verify_cost=measure_verify_cost(target, want_hidden=True), extra_nodes=lookup_nodes)
    drafter = head_drafter(head, **settings)
    if lookup_nodes > 0:
        lookup = PromptLookupDrafter(num_draft=lookup_nodes, streak_draft=lookup_streak)
        # the lookup drafter caps its own tree (lookup_nodes, or lookup_streak on a streak)
        drafter = MergedDrafter([drafter, lookup], extra_nodes=None)
    return drafter, target
