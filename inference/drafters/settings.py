"""The head drafters' own settings, typed: what a drafter class takes, under the names DraftSpec
(drafthead/draft_spec.py) and a head folder's drafting.json give them. DraftSpec checks the
values (once, where the CLI, Python callers and drafting.json meet); the drafters take them as
given. No torch here: the CLI's parser imports DraftSpec.

    TreeSettings        EagleDrafter (EAGLE-1/3/3.1, MTP): EAGLE-2's dynamic tree
    StaticTreeSettings  MedusaDrafter, HydraDrafter, ParallelDrafter, DFlashDrafter, DSparkDrafter
    HeadDrafting        a head's tree and the prompt-lookup nodes merged into it (inference/drafters/load.py)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import ClassVar, Union


@dataclass(frozen=True)
class TreeSettings:
    """EAGLE-2's tree: `depth` draft steps, each expanding the `branch` best frontier nodes into
    their `branch` best children, then the `num_draft` best nodes kept (None: 24, or every
    candidate when the drafter sizes its rounds by confidence)."""

    SHAPE: ClassVar[str] = "tree"

    num_draft: int | None = None
    depth: int = 5
    branch: int = 6

    @classmethod
    def chain(cls, k: int) -> TreeSettings:
        """k top-1 drafts a round (what vLLM and SGLang serve)."""
        return cls(num_draft=k, depth=k, branch=1)


@dataclass(frozen=True)
class StaticTreeSettings:
    """A static tree of per-depth candidates: `choices`, each a path of candidate ranks
    (inference/engine/tree.py tree_from_choices); else the `num_draft` best under a prior of
    per-depth accuracies (Medusa's search); neither: the drafter's default."""

    SHAPE: ClassVar[str] = "static"

    choices: tuple[tuple[int, ...], ...] | None = None
    num_draft: int | None = None

    @classmethod
    def chain(cls, k: int) -> StaticTreeSettings:
        """k top-1 drafts a round: rank 0 at every depth 1..k."""
        return cls(choices=tuple((0,) * d for d in range(1, k + 1)))


HeadTree = Union[TreeSettings, StaticTreeSettings]
_SHAPES: dict[str, type[HeadTree]] = {"tree": TreeSettings, "static": StaticTreeSettings}


@dataclass(frozen=True)
class HeadDrafting:
    """How a head drafts a round: its tree (None: the drafter's default) and `lookup_nodes`
    prompt-lookup nodes merged into it (0: none), whose continuation, once wholly accepted, comes
    back `lookup_streak` tokens long (None: no streaks)."""

    tree: HeadTree | None = None
    lookup_nodes: int = 0
    lookup_streak: int | None = None

    def to_dict(self) -> dict:
        """As JSON holds it (a served head's adapting worker reads it back: train/adapt/worker.py)."""
        tree = None if self.tree is None else {"shape": self.tree.SHAPE, **asdict(self.tree)}
        return {"tree": tree, "lookup_nodes": self.lookup_nodes, "lookup_streak": self.lookup_streak}

    @classmethod
    def from_dict(cls, d: dict) -> HeadDrafting:
        tree: HeadTree | None = None
        if d.get("tree"):
            fields = dict(d["tree"])
            shape = _SHAPES[fields.pop("shape")]
            if fields.get("choices") is not None:
                fields["choices"] = tuple(tuple(path) for path in fields["choices"])
            tree = shape(**fields)
        return cls(tree, d.get("lookup_nodes", 0), d.get("lookup_streak"))
