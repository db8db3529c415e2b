"""Drafts that the target accepts, on purpose: the exactness tests' way to reach the engine paths
that only accepted drafts take (the cache keeping a path that is not a prefix of the nodes, the
drafter catching up on several committed tokens, rows of a batch that accept different lengths).

An untrained head on a tiny random target is almost never right, so a test that decodes with it
checks rejection only. `OracleDrafter` wraps any real drafter: the drafter drafts as it always
does (its head runs, its caches and feature buffers move), then the tree's deepest path is
rewritten to the target's own greedy continuation, cut at the depth the test chooses. A draft is
any tree the verifier is handed, so exactness must hold for these trees as for the head's own;
only now the tests can count what was accepted.
"""

from __future__ import annotations

from typing import Callable

import torch

from drafthead.inference.engine.drafter import fork_drafter
from drafthead.inference.engine.tree import DraftTree, first_chain, node_depths

# (sequence index, round) -> the depth whose node on the path gets a wrong token (the drafts above
# it are accepted, it and those below are rejected), or None: the whole path is right
Cut = Callable[[int, int], "int | None"]


def never(sequence: int, round_: int) -> int | None:
    return None


def greedy_continuation(target) -> Callable[[tuple[int, ...], int], list[int]]:
    """history -> the target's next n greedy tokens after it, from plain forwards without a cache
    (memoised: every row and round asks about a few histories). A deterministic function of the
    history, so drafts made from it are valid point-mass drafts under sampling too."""
    memo: dict[tuple[int, ...], int] = {}
    device = next(target.parameters()).device

    def next_token(history: tuple[int, ...]) -> int:
        if history not in memo:
            with torch.no_grad():
                logits = target(torch.tensor([history], device=device)).logits[0, -1]
            memo[history] = int(logits.float().argmax())
        return memo[history]

    def continuation(history: tuple[int, ...], n: int) -> list[int]:
        out = []
        for _ in range(n):
            out.append(next_token(history + tuple(out)))
        return out

    return continuation


def known_continuation(sequences: list[list[int]]) -> Callable[[tuple[int, ...], int], list[int]]:
    """history -> the next n tokens of the one sequence (prompt + plain greedy output) it begins,
    without running the target: greedy decoding that stays exact never leaves these sequences.
    Past their end, or off them (a broken engine), the tokens are 0: drafts that fail."""

    def continuation(history: tuple[int, ...], n: int) -> list[int]:
        for seq in sequences:
            if tuple(seq[: len(history)]) == history:
                ahead = list(seq[len(history) : len(history) + n])
                return ahead + [0] * (n - len(ahead))
        return [0] * n

    return continuation


def spine(parents: torch.Tensor, last: bool = True) -> list[int]:
    """Root-first node indices of the path to a deepest node: the last one (in a static tree a
    later branch, so an accepted path is not a prefix of the node order), or the first (the
    branch that sampling's acceptance tries first at every depth)."""
    depths = node_depths(parents).tolist()
    order = (lambda i: (depths[i], i)) if last else (lambda i: (depths[i], -i))
    node = max(range(len(depths)), key=order)
    path = [node]
    while node > 0:
        node = int(parents[node])
        path.append(node)
    return path[::-1]


def rewrite(tree: DraftTree, truth: list[int], cut: int | None, vocab: int, last: bool = True) -> DraftTree:
    """The tree with its spine's node at depth d holding truth[d - 1], except at depth `cut`,
    which holds a wrong token; a sibling of a spine node that holds the spine's true token gets
    another one, so the verifier can only accept along the spine. truth: the true tokens after the
    root, one per depth of the spine."""
    tokens = tree.tokens.clone()
    parents = tree.parents.tolist()
    path = spine(tree.parents, last)
    for depth, node in enumerate(path[1:], start=1):
        right = truth[depth - 1]
        token = (right + 1) % vocab if depth == cut else right
        for sibling in range(1, len(parents)):
            if parents[sibling] == parents[node] and sibling != node and int(tokens[0, sibling]) == right:
                tokens[0, sibling] = (right + 2) % vocab
        tokens[0, node] = token
    # the tokens are now a deterministic function of the history: a point-mass draft (q = None)
    return DraftTree(tokens, tree.parents, None)


class RowDrafter:
    """A wrapper of a real drafter that knows which row of a batch it drafts for: `sequence` numbers
    the rows in prompt order, as the engine forks them (rows 1..B-1, before any row begins).
    Subclasses say what they add in `wrap` (a copy around another inner drafter)."""

    def __init__(self, inner, sequence: int = 0, counter: list | None = None):
        self.inner, self.sequence = inner, sequence
        self.counter = counter if counter is not None else [0]  # forks handed out in this call

    def __getattr__(self, name):  # feature_layers, needs_last_hidden, limit, describe, ...
        return getattr(self.inner, name)

    def wrap(self, inner, sequence: int) -> "RowDrafter":  # pragma: no cover - abstract
        raise NotImplementedError

    def fork(self) -> "RowDrafter":
        self.counter[0] += 1
        fork = self.wrap(fork_drafter(self.inner), self.counter[0])
        fork.counter = self.counter
        return fork

    def begin(self, tokens, features, pending) -> None:
        self.inner.begin(tokens, features, pending)
        if self.sequence == 0:  # row 0 begins after every fork of this call: the next call counts anew
            self.counter[0] = 0

    def commit(self, tokens, features, pending, stats) -> None:
        self.inner.commit(tokens, features, pending, stats)

    def propose(self) -> DraftTree:
        return self.inner.propose()


class OracleDrafter(RowDrafter):
    """A real drafter whose trees' deepest path (the last one; `last=False`: the first) is the
    target's continuation, cut at the depth `cut(row, round)` says. chain: the tree is first cut
    to its first chain, what a hybrid target verifies (inference/engine/hybrid_target.py)."""

    def __init__(self, inner, continuation, vocab: int, cut: Cut = never, sequence: int = 0, last: bool = True, chain: bool = False):
        super().__init__(inner, sequence)
        self.continuation, self.vocab, self.cut, self.last, self.chain = continuation, vocab, cut, last, chain
        self.round = 0
        self.seen: tuple[int, ...] = ()  # committed tokens and the pending one

    def wrap(self, inner, sequence: int) -> "OracleDrafter":
        return OracleDrafter(inner, self.continuation, self.vocab, self.cut, sequence, self.last, self.chain)

    def begin(self, tokens, features, pending) -> None:
        super().begin(tokens, features, pending)
        self.seen = tuple(tokens[0].tolist()) + (int(pending[0]),)
        self.round = 0

    def commit(self, tokens, features, pending, stats) -> None:
        super().commit(tokens, features, pending, stats)
        self.seen += tuple(tokens[0, 1:].tolist()) + (int(pending[0]),)
        if not stats.skipped:
            self.round += 1

    def propose(self) -> DraftTree:
        tree = self.inner.propose()
        if self.chain:
            tree = tree.subtree(first_chain(tree.parents))
        if tree.num_nodes == 1:
            return tree
        depth = int(node_depths(tree.parents).max())
        truth = self.continuation(self.seen, depth)
        return rewrite(tree, truth, self.cut(self.sequence, self.round), self.vocab, self.last)


def accepted_drafts(result) -> list[int]:
    """Draft tokens accepted in each round of one row (its emitted tokens less the target's own)."""
    return [n - 1 for n in result.accepted_lengths]


def every_third_rejected(sequence: int, round_: int) -> int | None:
    """Batch 1: two rounds whose whole path is right, then one whose first draft is wrong."""
    return 1 if round_ % 3 == 2 else None


def by_row(sequence: int, round_: int) -> int | None:
    """A ragged batch: row 0 is right to its tree's depth, row 1 to depth 1, row 2 not at all."""
    return (None, 2, 1)[sequence % 3]


def assert_accepts_and_stays_exact(
    target,
    drafter_of,
    prompt,
    reference: list[int],
    prompts,
    references,
    ids,
    mask,
    max_new_tokens: int,
    ragged_new_tokens: int,
    generate_config,
    vocab: int | None = None,
    chain: bool = False,
    images=None,
    batch_images=None,
) -> None:
    """The oracle-steered `drafter_of()` decodes `prompt` to `reference` while accepting paths of
    depth >= 2 in at least two rounds, and the ragged batch `ids`/`mask` (rows `prompts`) to
    `references` while its rows accept different lengths (row b is cut as `by_row` says).
    vocab: the target's vocabulary size, for a target that is no torch module (the llama.cpp backend).
    chain: the drafts are cut to chains first, as a hybrid target verifies them. images,
    batch_images: the prompts' images (media.PromptImages) for a vision-language target."""
    from drafthead.inference.engine.generate import speculative_generate

    vocab = vocab or target.get_input_embeddings().num_embeddings
    continuation = known_continuation([prompt[0].tolist() + reference] + [p.tolist() + r for p, r in zip(prompts, references)])
    oracle = OracleDrafter(drafter_of(), continuation, vocab, every_third_rejected, chain=chain)
    result = speculative_generate(target, oracle, prompt, generate_config(max_new_tokens), images=images)
    assert result.new_tokens[0].tolist() == reference
    drafts = accepted_drafts(result)
    assert sum(n >= 2 for n in drafts) >= 2, f"accepted drafts per round {drafts}: fewer than two of depth >= 2"
    assert 0 in drafts[:-1], f"accepted drafts per round {drafts}: no rejected round"

    batched = speculative_generate(
        target,
        OracleDrafter(drafter_of(), continuation, vocab, by_row, chain=chain),
        ids,
        generate_config(ragged_new_tokens),
        attention_mask=mask,
        images=batch_images,
    )
    assert [row.new_tokens[0].tolist() for row in batched.rows] == references
    longest = [max(accepted_drafts(row)) for row in batched.rows]
    assert longest == [longest[0], 1, 0] and longest[0] >= 2, f"most drafts a round accepted, per row: {longest}"
    _log_counts(deep=sum(n >= 2 for n in drafts), rounds=len(drafts), row_lengths=sorted({n for row in batched.rows for n in accepted_drafts(row)}))


def _log_counts(**counts) -> None:
    """With DRAFTHEAD_TEST_ACCEPT_LOG set, append one JSON line per cell (the test's id and the
    counts): how the acceptance figures of docs/testing.md are gathered over the whole table."""
    import json
    import os

    path = os.environ.get("DRAFTHEAD_TEST_ACCEPT_LOG")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"test": os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0], **counts}) + "\n")
