"""How a round drafts, in one frozen object: who drafts (proposer, head or draft model), how many
draft nodes (`num_draft`), the rule that sizes each round (`sizing`), the tree's shape, the
prompt-lookup nodes merged in, and the backend that verifies. The CLI's options, `data
regenerate`, the studies and Python callers each make one DraftSpec; `build()` turns it into the
drafter factory, the model to decode with, the verifier and the load policy.

    sizing   fixed       every round drafts the drafter's tree (num_draft nodes, or its default)
             policy      the load policy cuts each round's tree to the node count that pays at the
                         batch size, from the target's measured forward cost (down to plain decoding)
             confidence  the drafter's own acceptance estimate against that cost (EAGLE's path
                         probabilities, DSpark's confidence head); num_draft, when given, caps it

A head folder's `drafting.json` gives the defaults the spec's unset fields keep
(inference/drafters/head_drafters.py).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from typing import Any, Callable

from .proposers import PROPOSERS, default_head_path, make_drafter_factory

SIZINGS = ("fixed", "policy", "confidence")
BACKENDS = ("torch", "llama.cpp")
# what a batch of 16 rows x 32 nodes reaches: the token counts the load policy's cost curve is timed at
POLICY_TOKEN_COUNTS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


@dataclass(frozen=True)
class Drafting:
    """What `DraftSpec.build` returns: `factory()` gives a drafter with fresh state per prompt;
    `model` is the target to decode with (a Medusa-2 head merges its LoRA into it); `verifier`
    runs the tree forwards (`model`, or a llama.cpp target); `policy` is the load policy or None."""

    spec: DraftSpec
    factory: Callable[[], Any]
    model: Any
    verifier: Any
    policy: Any
    message: str  # one line: what drafts and why


@dataclass(frozen=True)
class DraftSpec:
    proposer: str | None = None  # None: `resolve` picks (the head shipped for the target, else prompt lookup)
    head: str | None = None  # a head folder (ours or a published layout)
    draft_model: str | None = None  # a draft LM's name or folder
    num_draft: int | None = None  # draft nodes per round; None: the drafter's default (drafting.json for heads)
    sizing: str | None = None  # SIZINGS; None: a head folder's drafting.json, else fixed
    depth: int | None = None  # EAGLE heads: draft steps per round
    branch: int | None = None  # EAGLE heads: children expanded per node and step
    chain: int | None = None  # heads: a chain of `chain` top-1 drafts a round instead of the head's tree
    lookup_nodes: int | None = None  # heads: prompt-lookup nodes merged into each tree (0: off)
    lookup_streak: int | None = None  # prompt lookup: length of the draft after a wholly accepted one (0: off)
    backend: str = "torch"  # BACKENDS: the verifier's forward
    gguf_type: str | None = None  # llama.cpp backend: the GGUF's weight type (default: the target dtype's)

    def __post_init__(self):
        """Settings no drafter can take, refused before any model loads."""
        if self.proposer is not None and self.proposer not in PROPOSERS:
            raise ValueError(f"unknown proposer '{self.proposer}': use one of {', '.join(PROPOSERS)}")
        if self.sizing is not None and self.sizing not in SIZINGS:
            raise ValueError(f"unknown sizing '{self.sizing}': use one of {', '.join(SIZINGS)}")
        if self.backend not in BACKENDS:
            raise ValueError(f"unknown backend '{self.backend}': use one of {', '.join(BACKENDS)}")
        for name, low in (("num_draft", 1), ("depth", 1), ("branch", 1), ("chain", 1), ("lookup_nodes", 0), ("lookup_streak", 0)):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < low):
                raise ValueError(f"--{name.replace('_', '-')} must be a whole number >= {low}{' (0: off)' if low == 0 else ''}, got {value!r}")
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
        if self.chain is not None and (self.num_draft, self.depth, self.branch) != (None, None, None):
            raise ValueError("--chain K drafts K nodes a round, a chain: it takes no --num-draft, --tree-depth or --tree-branch")
        if self.chain is not None and self.sizing == "confidence":
            raise ValueError("--chain K is a fixed chain: it cannot be sized by the drafter's confidence")
        heads_only = [name for name in ("depth", "branch", "chain", "lookup_nodes") if getattr(self, name) is not None]
        if heads_only and self.proposer not in (None, "head"):
            raise ValueError(f"--{heads_only[0].replace('_', '-')} is a head drafter's setting, not {self.proposer}'s")

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
                raise ValueError(f"no head ships for {target_name}; pass --head DIR")
            head = str(shipped)
        spec = replace(self, proposer=proposer, head=head)
        if proposer == "none":
            return spec, "no drafts: plain decoding in our engine"
        what = {"head": f"the head at {head}", "draft-model": f"draft model {self.draft_model}", "prompt-lookup": "prompt lookup"}
        return spec, f"drafting with {what[proposer]}"

    def drafter_options(self) -> dict:
        """The resolved proposer's constructor options: the one translation from the spec's names
        to each drafter's (unset fields are left out, so a head's drafting.json keeps them)."""
        options: dict[str, object]
        if self.proposer == "none":
            options = {}
        elif self.proposer == "prompt-lookup":
            options = {"num_draft": self.num_draft, "streak_draft": self.lookup_streak}
        elif self.proposer == "head":
            options = {
                "num_draft": self.num_draft,
                "depth": self.depth,
                "top_k": self.branch,
                "chain": self.chain,
                "lookup_nodes": self.lookup_nodes,
                "lookup_streak": self.lookup_streak,
            }
            if self.sizing is not None:  # the load policy is the engine's: the drafter drafts its fixed tree
                options["sizing"] = "fixed" if self.sizing == "policy" else self.sizing
        elif self.proposer == "draft-model":
            options = {"num_draft": self.num_draft}
        else:
            raise ValueError("resolve() the spec before building: its proposer is not chosen")
        return {k: v for k, v in options.items() if v is not None}

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
        """The drafter factory, decoding model, verifier and load policy for `loaded` (a
        LoadedTarget); the spec is resolved first if it was not. `note` gets status lines;
        row_invariant: the kernels the load policy times (GenerationConfig.row_invariant)."""
        note = note or _stderr
        spec, message = self.resolve(loaded.name)
        kw = spec.drafter_options()
        if spec.proposer == "head":
            kw.update(head=spec.head, target_name=loaded.name)
        elif spec.proposer == "draft-model":
            kw.update(draft_model=spec.draft_model, sampling=sampling, seed=seed)
        assert spec.proposer is not None  # resolve() chose it
        factory, model = make_drafter_factory(spec.proposer, loaded.model, loaded.tokenizer, **kw)
        verifier = spec._verifier(loaded, model, threads, note)
        policy = spec._policy(verifier, factory(), row_invariant, note) if spec.sizing == "policy" else None
        return Drafting(spec, factory, model, verifier, policy, message)

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

    @staticmethod
    def _policy(verifier, drafter, row_invariant: bool | None, note):
        """The load policy (inference/engine/policy.py), with the verifier's forward timed once at
        POLICY_TOKEN_COUNTS the way it is called in rounds."""
        from .inference.engine.cost import measure_verify_cost
        from .inference.engine.policy import SpeculationPolicy

        context = 128  # cached tokens behind the timed forward (measure_verify_cost's default)
        limit = getattr(verifier.config.get_text_config(), "max_position_embeddings", None) or 10**9
        counts = [n for n in POLICY_TOKEN_COUNTS if context + n <= limit] or [1, 2]
        note("sizing policy: timing the target's forward at " + ", ".join(map(str, counts)) + " tokens")
        want_hidden = bool(drafter.feature_layers) or drafter.needs_last_hidden
        return SpeculationPolicy(
            measure_verify_cost(
                verifier, counts, context=context, want_hidden=want_hidden, feature_layers=drafter.feature_layers, row_invariant=row_invariant
            )
        )


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
