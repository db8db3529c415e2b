"""A head folder -> its drafter: the head loaded (our layout) or imported (a published one), then
wrapped in the drafter its heads/config.py KINDS row names, drafting as the caller's HeadDrafting
says (settings.py; drafthead/draft_spec.py makes it, from the CLI, Python and the folder's
drafting.json)."""

from __future__ import annotations

from pathlib import Path

from ...heads.config import head_kind, resolve
from ...heads.formats import detect_layout, import_head
from ...heads.registry import load_head
from ..kernels.target_linears import dispatch_linears
from .merged import MergedDrafter
from .prompt_lookup import PromptLookupDrafter
from .settings import HeadDrafting, HeadTree, StaticTreeSettings, TreeSettings


def tree_settings_class(kind: str) -> type[HeadTree]:
    """The tree settings `kind`'s drafter takes: EAGLE's tree for kinds that grow one, else a static tree."""
    return TreeSettings if head_kind(kind).grows_tree else StaticTreeSettings


def chain_settings(kind: str, k: int) -> HeadTree:
    """A chain of k top-1 drafts a round, in the terms of `kind`'s drafter."""
    return tree_settings_class(kind).chain(k)


def head_drafter(head, tree: HeadTree | None = None):
    """`head` in the drafter its KINDS row names, drafting `tree` (None: the drafter's default).
    The head is used as it is: no eval(), no linear dispatch, so a head still training can be
    replayed."""
    drafter = resolve(head_kind(head.kind).drafter)
    return drafter(head) if tree is None else drafter(head, tree)


def load_head_drafter(path, target_model, tokenizer, target_name: str | None = None, drafting: HeadDrafting = HeadDrafting()):
    """Load a head folder for `target_model` and wrap it in its drafter, drafting `drafting`.

    `drafting.lookup_nodes` > 0 merges that many prompt-lookup nodes into every tree
    (MergedDrafter): n-gram continuations catch the text a model repeats, where a head is least
    sure; `lookup_streak` lets a continuation that was wholly accepted come back that long next
    round (PromptLookupDrafter.lookup_streak). Returns (drafter, target): a Medusa-2 head carries
    a LoRA adapter merged into the target, and that adapted target is the one whose output the
    speculative path reproduces.
    """
    if detect_layout(path) == "ours":
        head, target = load_head(Path(path), target_model, tokenizer, target_name=target_name)
    else:  # a published layout (vLLM, speculators, upstream EAGLE/Medusa...), read exactly or refused
        head, target = import_head(path, target_model, tokenizer, target_name=target_name), target_model
    head.eval()
    dispatch_linears(head)  # draft steps multiply a few rows by every head weight (inference/kernels/target_linears.py)
    drafter = head_drafter(head, drafting.tree)
    if drafting.lookup_nodes > 0:
        lookup = PromptLookupDrafter(num_draft=drafting.lookup_nodes, lookup_streak=drafting.lookup_streak)
        # the lookup drafter caps its own tree (lookup_nodes, or lookup_streak on a streak)
        drafter = MergedDrafter([drafter, lookup], extra_nodes=None)
    return drafter, target
