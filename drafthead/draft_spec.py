"""How a round drafts, in one frozen object: who drafts (proposer, head or draft model), how many
draft nodes (`num_draft`), the rule that sizes each round (`sizing`), the tree's shape, the
prompt-lookup nodes merged in, and the backend that verifies. The CLI's options, `data
regenerate`, `serve`, the studies and Python callers each make one DraftSpec; `build()` turns it
into the drafter factory, the model to decode with and the verifier.

A setting travels in three typed hops, under one name: the CLI option or Python keyword, this
spec's field (every rule checked here, once), and the drafter class's own settings
(inference/drafters/settings.py) or constructor argument. A head folder's `drafting.json` holds
the same names, read once by `build` into the fields the caller left unset.

    sizing   fixed       every round drafts the drafter's tree (num_draft nodes, or its default)
             policy      the engine's load policy cuts each round's tree to the node count that pays
                         at the batch size, from the target's measured forward cost (down to plain
                         decoding; inference/engine/sizing.py)
             confidence  the drafter's own acceptance estimate against that cost (EAGLE's path
                         probabilities, DSpark's confidence head); num_draft, when given, caps it
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

from .inference.drafters.settings import HeadDrafting, HeadTree
from .inference.engine.sizing import check_sizing
from .proposers import default_head_path, head_layout

PROPOSERS = ("prompt-lookup", "draft-model", "head", "none")
BACKENDS = ("torch", "llama.cpp")
DRAFTING_FILE = "drafting.json"  # optional, beside a head's config.json: the drafting measured best for it
# the fields a drafting.json may set: a head's tree, its sizing and its merged prompt lookup
DRAFTING_KEYS = ("num_draft", "sizing", "depth", "branch", "choices", "lookup_nodes", "lookup_streak")
# each whole-number field: its CLI option and its least value
WHOLE = {
    "num_draft": ("--num-draft", 1),
    "depth": ("--tree-depth", 1),
    "branch": ("--tree-branch", 1),
    "chain": ("--chain", 1),
    "lookup_nodes": ("--lookup-nodes", 0),
    "lookup_streak": ("--lookup-streak", 0),
}
LOOKUP_STREAK = 32  # prompt lookup alone: a streak's length, measured ahead of no streak on MT-bench (docs/results.md)
DRAFT_MODEL_NUM_DRAFT = 4  # a draft model's chain when num_draft is not given


@dataclass(frozen=True)
class Drafting:
    """What `DraftSpec.build` returns: `factory()` gives a drafter with fresh state per prompt;
    `model` is the target to decode with (a Medusa-2 head merges its LoRA into it); `verifier`
    runs the tree forwards (`model`, or a llama.cpp target). `spec` is resolved: its proposer and
    head chosen, a head's drafting.json read in; `head_drafting` is what a head drafts."""

    spec: DraftSpec
    factory: Callable[[], Any]
    model: Any
    verifier: Any
    sizing: str  # the rule that sizes each round, for GenerationConfig (inference/engine/sizing.py)
    message: str  # one line: what drafts and why
    head_drafting: HeadDrafting | None = None


@dataclass(frozen=True)
class DraftSpec:
    proposer: str | None = None  # None: `resolve` picks (the head shipped for the target, else prompt lookup)
    head: str | None = None  # a head folder (ours or a published layout)
    draft_model: str | None = None  # a draft LM's name or folder
    num_draft: int | None = None  # draft nodes per round; None: the drafter's default (drafting.json for heads)
    sizing: str | None = None  # SIZINGS; None: a head folder's drafting.json, else fixed
    depth: int | None = None  # heads that grow a tree (EAGLE): draft steps per round
    branch: int | None = None  # heads that grow a tree (EAGLE): children expanded per node and step
    choices: tuple[tuple[int, ...], ...] | None = None  # heads with a static tree: its paths of candidate ranks
    chain: int | None = None  # heads: a chain of `chain` top-1 drafts a round instead of the head's tree
    lookup_nodes: int | None = None  # heads: prompt-lookup nodes merged into each tree (0: off)
    lookup_streak: int | None = None  # prompt lookup: length of the draft after a wholly accepted one (0: off)
    backend: str = "torch"  # BACKENDS: the verifier's forward
    gguf_type: str | None = None  # llama.cpp backend: the GGUF's weight type (default: the target dtype's)

    def __post_init__(self):
        """Every rule on the settings, before any model loads: each in this one place."""
        if self.proposer is not None and self.proposer not in PROPOSERS:
            raise ValueError(f"unknown proposer '{self.proposer}': use one of {', '.join(PROPOSERS)}")
        if self.sizing is not None:
            check_sizing(self.sizing)
        if self.backend not in BACKENDS:
            raise ValueError(f"unknown backend '{self.backend}': use one of {', '.join(BACKENDS)}")
        for name, (option, low) in WHOLE.items():
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < low):
                raise ValueError(f"{name} ({option}) must be a whole number >= {low}{' (0: off)' if low == 0 else ''}, got {value!r}")
        if self.choices is not None:
            object.__setattr__(self, "choices", _checked_choices(self.choices))
        if self.sizing == "confidence" and self.proposer not in (None, "head"):
            raise ValueError(f"sizing 'confidence' sizes EAGLE trees and DSpark blocks, not {self.proposer} drafts")
        if self.proposer == "none" and (self.num_draft is not None or self.sizing not in (None, "fixed") or self.lookup_streak is not None):
            raise ValueError("--proposer none decodes plainly: it takes no --num-draft, --sizing or --lookup-streak")
        if self.proposer == "draft-model" and self.draft_model is None:
            raise ValueError("--proposer draft-model needs --draft-model NAME")
        # a drafter named for a proposer that does not draft with it would be ignored
        for name, proposer in (("head", "head"), ("draft_model", "draft-model")):
            if getattr(self, name) is not None and self.proposer not in (None, proposer):
                raise ValueError(f"--{name.replace('_', '-')} drafts for --proposer {proposer}, not {self.proposer}: drop one of them")
        if self.head is not None and self.draft_model is not None:
            raise ValueError("--head and --draft-model name two drafters: pass one")
        if self.chain is not None and (self.num_draft, self.depth, self.branch, self.choices) != (None, None, None, None):
            raise ValueError("--chain K drafts K nodes a round, a chain: it takes no --num-draft, --tree-depth, --tree-branch or choices")
        if self.chain is not None and self.sizing == "confidence":
            raise ValueError("--chain K is a fixed chain: it cannot be sized by the drafter's confidence")
        heads_only = [name for name in ("depth", "branch", "choices", "chain", "lookup_nodes") if getattr(self, name) is not None]
        if heads_only and self.proposer not in (None, "head"):
            raise ValueError(f"{_spelling(heads_only[0])} is a head drafter's setting, not {self.proposer}'s")

    @classmethod
    def from_args(cls, args) -> DraftSpec:
        """The spec of the CLI's drafting options (drafthead/commands add_proposer_options)."""
        return cls(
            proposer=getattr(args, "proposer", None),
            head=getattr(args, "head", None),
            draft_model=getattr(args, "draft_model", None),
            num_draft=getattr(args, "num_draft", None),
            sizing=getattr(args, "sizing", None),
            depth=getattr(args, "tree_depth", None),
            branch=getattr(args, "tree_branch", None),
            chain=getattr(args, "chain", None),
            lookup_nodes=getattr(args, "lookup_nodes", None),
            lookup_streak=getattr(args, "lookup_streak", None),
            backend=getattr(args, "backend", "torch"),
            gguf_type=getattr(args, "gguf_type", None),
        )

    def resolve(self, target_name: str) -> tuple[DraftSpec, str]:
        """(this spec with its proposer and head chosen for `target_name`, a line saying what
        drafts and why): no proposer means the head given, else the draft model given, else the
        head shipped for the target, else prompt lookup."""
        proposer, head = self.proposer, self.head
        if proposer is None:
            if head is not None:
                proposer = "head"
            elif self.draft_model is not None:
                proposer = "draft-model"
            else:
                shipped = default_head_path(target_name)
                if shipped is not None:
                    return (replace(self, proposer="head", head=str(shipped)), f"drafting with the head shipped for {target_name} ({shipped})")
                if self.sizing == "confidence":  # prompt lookup cannot size itself
                    raise ValueError(f"sizing 'confidence' needs an EAGLE or DSpark head, and none ships for {target_name}: pass --head DIR")
                return (replace(self, proposer="prompt-lookup"), f"no trained head ships for {target_name} yet: drafting with prompt lookup")
        if proposer == "head" and head is None:
            shipped = default_head_path(target_name)
            if shipped is None:
                raise ValueError(f"the head proposer needs a trained head folder, and no head ships for {target_name}: pass --head DIR")
            head = str(shipped)
        spec = replace(self, proposer=proposer, head=head)
        if proposer == "none":
            return spec, "no drafts: plain decoding in our engine"
        what = {"head": f"the head at {head}", "draft-model": f"draft model {self.draft_model}", "prompt-lookup": "prompt lookup"}
        return spec, f"drafting with {what[proposer]}"

    def with_head_folder(self) -> tuple[DraftSpec, str | None]:
        """(this spec with the head folder's drafting.json read into the fields it leaves unset, the
        head's kind), every setting checked against that kind; for other proposers (self, None)."""
        if self.proposer != "head":
            return self, None
        assert self.head is not None  # resolve() chose it
        folder = Path(self.head)
        if not folder.is_dir():
            raise FileNotFoundError(f"no head folder at {folder}")
        _, kind = head_layout(folder)
        if kind is None:
            raise ValueError(f"{folder}: its config names no head kind")
        check_kind(kind, self, "")
        spec = self
        file = folder / DRAFTING_FILE
        if file.is_file():
            stated = read_drafting(file)
            check_kind(kind, stated, f"{file}: ")
            if self.chain is not None:  # the chain replaces the tree drafting.json describes
                stated = replace(stated, num_draft=None, depth=None, branch=None, choices=None, sizing=None)
            spec = replace(self, **{name: getattr(stated, name) for name in DRAFTING_KEYS if getattr(self, name) is None})
        return spec, kind

    def head_drafting(self, kind: str) -> HeadDrafting:
        """The head drafter's own settings: its tree, in the terms of `kind`'s drafter (the field
        names are theirs: nothing is renamed), and the prompt lookup merged in."""
        from .inference.drafters.load import chain_settings, tree_settings_class

        tree: HeadTree | None
        if self.chain is not None:
            tree = chain_settings(kind, self.chain)
        else:
            given = {name: getattr(self, name) for name in ("num_draft", "depth", "branch", "choices") if getattr(self, name) is not None}
            tree = tree_settings_class(kind)(**given) if given else None
        return HeadDrafting(tree, self.lookup_nodes or 0, self.lookup_streak)

    def build(
        self,
        loaded,
        *,
        sampling=None,
        seed: int | None = None,
        threads: int | None = None,
        row_invariant: bool | None = None,
        note: Callable[[str], None] | None = None,
    ) -> Drafting:
        """The drafter factory, decoding model and verifier for `loaded` (a LoadedTarget: name,
        model, tokenizer, path); the spec is resolved first. What the sizing rule needs is built
        by the engine now (inference/engine/sizing.py prepare_sizing), so the first generation
        does not time it. `note` gets status lines; row_invariant: the kernels the verifier's
        cost is timed with (GenerationConfig.row_invariant; None: the engine's default)."""
        note = note or _stderr
        spec, message = self.resolve(loaded.name)
        spec, kind = spec.with_head_folder()
        sizing = spec.sizing or "fixed"
        spec = replace(spec, sizing=sizing)
        factory, model, drafting = spec._factory(loaded, kind, sampling, seed)
        verifier = spec._verifier(loaded, model, threads, note)
        if sizing != "fixed":
            from .inference.engine.backend import row_invariant_by_default
            from .inference.engine.sizing import prepare_sizing

            settled = row_invariant_by_default(verifier) if row_invariant is None else row_invariant
            prepare_sizing(verifier, factory(), sizing, settled, note)
        return Drafting(spec, factory, model, verifier, sizing, message, drafting)

    def _factory(self, loaded, kind: str | None, sampling, seed) -> tuple[Callable[[], Any], Any, HeadDrafting | None]:
        """(factory, the model to decode with, a head's drafting) for the resolved proposer: a head
        or a draft model is loaded once, and a head drafter reused (its `begin` starts afresh);
        the other drafters are made per prompt."""
        if self.proposer == "none":
            from .inference.engine.drafter import RootOnlyDrafter

            return RootOnlyDrafter, loaded.model, None
        if self.proposer == "prompt-lookup":
            from .inference.drafters.prompt_lookup import PromptLookupDrafter

            streak = LOOKUP_STREAK if self.lookup_streak is None else self.lookup_streak
            return (lambda: PromptLookupDrafter(num_draft=self.num_draft, lookup_streak=streak)), loaded.model, None
        if self.proposer == "draft-model":
            from .inference.drafters.draft_model import DraftModelDrafter
            from .inference.engine.sampling import SamplingConfig
            from .proposers import load_draft_model

            draft = load_draft_model(self.draft_model, loaded.model, loaded.tokenizer)
            num_draft = DRAFT_MODEL_NUM_DRAFT if self.num_draft is None else self.num_draft
            return (lambda: DraftModelDrafter(draft, num_draft=num_draft, sampling=sampling or SamplingConfig(), seed=seed)), loaded.model, None
        assert self.head is not None and kind is not None  # resolve() and with_head_folder() settled them
        from .heads.formats import detect_layout
        from .heads.formats.common import ConventionNeeded
        from .inference.drafters.load import load_head_drafter

        drafting = self.head_drafting(kind)
        try:
            drafter, model = load_head_drafter(self.head, loaded.model, loaded.tokenizer, loaded.name, drafting)
        except ConventionNeeded as e:  # --head has no --convention: the import command does
            raise ConventionNeeded(f"{e}. Convert it once with `drafthead import {self.head} --convention ... --out DIR` and pass --head DIR") from e
        layout = detect_layout(self.head)
        if layout != "ours":
            print(
                f"drafthead: {self.head} is a {layout} checkpoint, read exactly into a {kind} head "
                "(`drafthead import` saves it as a drafthead head folder)",
                file=sys.stderr,
            )
        return (lambda: drafter), model, drafting

    def _verifier(self, loaded, model, threads, note):
        """`model` itself, or (backend llama.cpp) a LlamaCppTarget on a GGUF of the target that
        llama.cpp's converter makes once (inference/llamacpp/convert.py)."""
        if self.backend != "llama.cpp":
            return model
        if model is not loaded.model:
            raise ValueError(
                "this head adapts the target (Medusa-2's LoRA), and the llama.cpp backend's GGUF holds "
                "the target without it: run it on --backend torch"
            )
        return llamacpp_target(loaded, self.gguf_type, threads, note)


def check_kind(kind: str, spec: DraftSpec, where: str) -> None:
    """The settings a head of `kind` takes: a tree's depth and branch for kinds that grow one,
    choices for static trees, sizing by confidence for kinds that size themselves (heads/config.py
    KINDS). `where` prefixes the error (a drafting.json's path)."""
    from .heads.config import head_kind

    known = head_kind(kind)
    if spec.sizing == "confidence" and not known.sizes_itself:
        raise ValueError(f"{where}sizing 'confidence' sizes EAGLE trees and DSpark blocks; {kind} heads take a number of nodes")
    wrong = ("choices",) if known.grows_tree else ("depth", "branch")
    given = [name for name in wrong if getattr(spec, name) is not None]
    if given:
        tree = "an EAGLE tree, grown step by step (--tree-depth, --tree-branch)" if known.grows_tree else "a static tree (choices)"
        raise ValueError(f"{where}{_spelling(given[0])} does not shape a {kind} head's tree: it drafts {tree}")


def read_drafting(file: Path) -> DraftSpec:
    """A head folder's drafting.json as the spec it states: only DRAFTING_KEYS, each checked as
    the spec checks it; the error names the file."""
    from .ground.files import read_json

    stated = read_json(file)  # not JSON, not UTF-8, or not an object: one line naming the file
    unknown = sorted(set(stated) - set(DRAFTING_KEYS))
    if unknown:
        raise ValueError(f"{file}: unknown keys {unknown} (known: {', '.join(DRAFTING_KEYS)})")
    try:
        return DraftSpec(proposer="head", **stated)
    except ValueError as e:
        raise ValueError(f"{file}: {e}") from None


def build_drafter(proposer: str, target, tokenizer, **settings):
    """A drafter for `target` (a transformers model) by proposer name, with DraftSpec's settings
    (`head=DIR`, `num_draft=8`, `draft_model=NAME`, ...): DraftSpec's build, its first drafter.
    A head that adapts the target (Medusa-2) needs DraftSpec.build, which returns the adapted
    model to decode with."""
    name = Path(str(getattr(getattr(target, "config", None), "_name_or_path", "") or "target")).name
    loaded = _Loaded(name=name, model=target, tokenizer=tokenizer)
    drafting = DraftSpec(proposer=proposer, **settings).build(loaded, note=lambda line: None)
    if drafting.model is not target:
        raise ValueError("this head adapts the target (Medusa-2 LoRA): use DraftSpec.build, which returns the adapted target to decode with")
    return drafting.factory()


@dataclass(frozen=True)
class _Loaded:
    """What `build` reads of a LoadedTarget, for a model a caller holds."""

    name: str
    model: Any
    tokenizer: Any
    path: Path | None = None


def _checked_choices(choices) -> tuple[tuple[int, ...], ...]:
    """choices as a tuple of paths (lists from JSON, tuples from Python), each a path of candidate ranks >= 0."""
    if isinstance(choices, (list, tuple)) and all(
        isinstance(path, (list, tuple)) and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in path) for path in choices
    ):
        return tuple(tuple(path) for path in choices)
    raise ValueError(f"choices must be a list of paths, each a list of candidate ranks >= 0, got {choices!r}")


def _spelling(name: str) -> str:
    """A setting as both its readers know it: the field, and its CLI option where it has one."""
    return f"{name} ({WHOLE[name][0]})" if name in WHOLE else name


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def llamacpp_target(loaded, gguf_type: str | None, threads: int | None, note: Callable[[str], None] | None = None):
    """A LlamaCppTarget on a GGUF of the loaded target (`gguf_type`, default the one its dtype
    holds), made once by llama.cpp's converter; features come back in the target's dtype."""
    import torch

    from .inference.llamacpp.convert import DTYPE_GGUF, target_gguf
    from .inference.llamacpp.target import LlamaCppTarget

    parameter = next(loaded.model.parameters())
    if parameter.device.type != "cpu":
        raise ValueError("--backend llama.cpp runs on the CPU: drop --device")
    gguf_type = gguf_type or DTYPE_GGUF[str(parameter.dtype).removeprefix("torch.")]
    (note or _stderr)(f"llama.cpp backend: the target as a {gguf_type} GGUF (made once by llama.cpp's converter)")
    path = target_gguf(loaded.path, gguf_type)
    return LlamaCppTarget(path, loaded.model.config, threads=threads or torch.get_num_threads(), feature_dtype=parameter.dtype)
