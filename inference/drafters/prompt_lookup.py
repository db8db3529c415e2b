"""Prompt lookup (n-gram) drafting: continue the sequence the way it continued before.

Like transformers' `prompt_lookup_num_tokens`, but the continuations of several earlier matches
are merged into one token tree (a trie), so the verifier can accept whichever one the target
follows. Needs no training and no model.

Two additions for text that copies itself (small models loop; lists and code repeat):
  * a continuation that runs into the present is extended periodically: if the text after the
    match is what followed it, the text after *that* is the same again (period = the distance
    from the match to the end);
  * streaks: after a round that accepted a whole continuation, the next round drafts a longer
    one (`lookup_streak`), since copying tends to go on; the first miss returns to `length`.
"""

from __future__ import annotations

import torch

from ..engine.drafter import DrafterBase
from ..engine.tree import DraftTree


def periodic_continuation(history: list[int], start: int, length: int) -> list[int]:
    """Up to `length` tokens that follow history[:start], extended past the end of `history`
    as a repetition of history[start:] (the text since the match repeats itself)."""
    cont = history[start : start + length]
    period = len(history) - start
    while 0 < len(cont) < length and period > 0:
        cont.append(cont[len(cont) - period])
    return cont


def find_continuations(history: list[int], max_ngram: int, min_ngram: int, length: int, max_matches: int) -> list[list[int]]:
    """Continuations that followed earlier occurrences of the longest suffix n-gram of `history`
    (n from max_ngram down to min_ngram), most recent match first, at most `max_matches`, each
    `length` tokens long (see `periodic_continuation`)."""
    end = len(history)
    for n in range(min(max_ngram, end - 1), min_ngram - 1, -1):
        suffix = history[end - n :]
        found: list[list[int]] = []
        seen: set[tuple[int, ...]] = set()
        # scan right to left: recent text predicts best; the suffix itself sits at end - n
        for start in range(end - n - 1, -1, -1):
            if history[start : start + n] == suffix:
                cont = periodic_continuation(history, start + n, length)
                key = tuple(cont)
                if cont and key not in seen:
                    seen.add(key)
                    found.append(cont)
                    if len(found) >= max_matches:
                        break
        if found:
            return found
    return []


def trie_tree(root: int, branches: list[list[int]], num_draft: int) -> tuple[list[int], list[int]]:
    """Merge token sequences into a trie under `root`, breadth-first, at most num_draft drafts.
    Returns (tokens, parents) with node 0 = root, in topological (BFS) order."""
    tokens, parents = [root], [-1]
    child_of: dict[tuple[int, int], int] = {}
    frontier = [(0, b) for b in branches]  # (node the branch hangs under, remaining tokens)
    while frontier and len(tokens) - 1 < num_draft:
        next_frontier = []
        for node, rest in frontier:
            if not rest or len(tokens) - 1 >= num_draft:
                continue
            key = (node, rest[0])
            if key not in child_of:
                child_of[key] = len(tokens)
                tokens.append(rest[0])
                parents.append(node)
            next_frontier.append((child_of[key], rest[1:]))
        frontier = next_frontier
    return tokens, parents


class PromptLookupDrafter(DrafterBase):
    def __init__(
        self,
        length: int | None = None,
        max_ngram: int = 3,
        min_ngram: int = 1,
        max_matches: int = 4,
        num_draft: int | None = None,
        lookup_streak: int | None = None,
    ):
        """num_draft: draft nodes per round, the merged trie's size (default 2 * length); length:
        tokens per continuation (default 10, at most num_draft). lookup_streak: after a round that
        accepted `length` or more of this drafter's tokens, draft one continuation (the most recent
        match) this long (None or <= length: off)."""
        super().__init__()
        if length is None:
            length = 10 if num_draft is None else min(10, num_draft)
        if length < 1 or min_ngram < 1 or max_ngram < min_ngram:
            raise ValueError("need length >= 1 and 1 <= min_ngram <= max_ngram")
        self.length = length
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.max_matches = max_matches
        self.num_draft = num_draft or length * 2
        self.lookup_streak = lookup_streak if lookup_streak and lookup_streak > length else None
        self.on_streak = False

    def describe(self) -> dict:
        return {
            "kind": "prompt-lookup",
            "length": self.length,
            "num_draft": self.num_draft,
            "max_ngram": self.max_ngram,
            "min_ngram": self.min_ngram,
            "max_matches": self.max_matches,
            "lookup_streak": self.lookup_streak,
        }

    def begin(self, tokens, features, pending) -> None:
        super().begin(tokens, features, pending)
        self.on_streak = False

    def commit(self, tokens, features, pending, stats) -> None:
        super().commit(tokens, features, pending, stats)
        self.on_streak = self.lookup_streak is not None and stats.accepted_on_path >= self.length

    def propose(self) -> DraftTree:
        assert self.history is not None  # set by begin
        history = self.history[0].tolist()
        # on a streak: one continuation (the most recent match), lookup_streak long
        if self.on_streak:
            assert self.lookup_streak is not None  # on_streak is set only with a lookup_streak
            length, matches, num_draft = self.lookup_streak, 1, self.lookup_streak
        else:
            length, matches, num_draft = self.length, self.max_matches, self.num_draft
        branches = find_continuations(history, self.max_ngram, self.min_ngram, length, matches)
        tokens, parents = trie_tree(history[-1], branches, num_draft)
        device = self.history.device
        return DraftTree(torch.tensor([tokens], device=device), torch.tensor(parents, device=device))
