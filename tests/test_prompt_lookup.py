"""Prompt lookup's rules: periodic continuations, longest n-gram first, streaks."""

import torch

from drafthead.inference.engine.drafter import RoundStats
from drafthead.inference.drafters.prompt_lookup import PromptLookupDrafter, find_continuations, periodic_continuation


def test_periodic_continuation_repeats_the_text_since_the_match():
    history = [7, 1, 2, 3, 1, 2]
    # after the match ending at index 3 the text went 1, 2 (period 2 up to the end): keep repeating
    assert periodic_continuation(history, 4, 5) == [1, 2, 1, 2, 1]
    # enough text after the match: no extension
    assert periodic_continuation(history, 1, 3) == [1, 2, 3]
    assert periodic_continuation(history, 6, 4) == []  # nothing after the match


def test_find_continuations_prefers_the_longest_suffix_and_recent_matches():
    history = [5, 6, 9, 1, 5, 6, 8, 2, 4, 6, 3, 5, 6]
    # the 2-gram (5, 6) matched twice; most recent first, each 3 tokens long
    assert find_continuations(history, 3, 1, 3, 4) == [[8, 2, 4], [9, 1, 5]]
    assert find_continuations(history, 3, 1, 3, 1) == [[8, 2, 4]]
    # a loop of period 3: the continuation runs on past the end of the history
    assert find_continuations([4, 1, 2, 3, 1, 2, 3], 3, 1, 7, 4)[0] == [1, 2, 3, 1, 2, 3, 1]
    assert find_continuations([1, 2, 3], 3, 1, 4, 4) == []  # the last token never occurred before


def _proposed(drafter):
    tree = drafter.propose()
    return tree.tokens[0, 1:].tolist(), tree.parents.tolist()


def test_streak_lengthens_the_continuation_until_a_miss():
    history = torch.tensor([[1, 2, 3, 4, 1, 2, 3, 4, 1]])
    d = PromptLookupDrafter(length=3, max_matches=1, lookup_streak=8)
    d.begin(history[:, :-1], None, history[:, -1])
    assert _proposed(d)[0] == [2, 3, 4]
    # the whole continuation was accepted: next round drafts 8 tokens, as one chain
    d.commit(torch.tensor([[1, 2, 3, 4]]), None, torch.tensor([1]), RoundStats(3, 3, 3, [1, 2, 3], [0, 1, 2, 3]))
    tokens, parents = _proposed(d)
    assert tokens == [2, 3, 4, 1, 2, 3, 4, 1]
    assert parents == [-1, 0, 1, 2, 3, 4, 5, 6, 7]
    # a miss (2 of 8 accepted; the target said 9): back to num_draft
    d.commit(torch.tensor([[1, 2, 3]]), None, torch.tensor([9]), RoundStats(8, 2, 8, [1, 2], [0, 1, 2]))
    assert not d.on_streak
    assert len(_proposed(d)[0]) <= 3


def test_streak_off_by_default_and_when_not_longer():
    for d in (PromptLookupDrafter(length=3), PromptLookupDrafter(length=3, lookup_streak=3)):
        d.begin(torch.tensor([[1, 2, 3, 1, 2]]), None, torch.tensor([3]))
        d.commit(torch.tensor([[3, 1, 2, 3]]), None, torch.tensor([1]), RoundStats(3, 3, 3, [1, 2, 3], [0, 1, 2, 3]))
        assert not d.on_streak
