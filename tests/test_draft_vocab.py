"""EAGLE-3's reduced draft vocabulary: hand-made counts, a slow twin, and the validity rule."""

from __future__ import annotations

import pytest
import torch

from drafthead.heads.draft_vocab import (
    build_draft_vocab,
    count_tokens,
    draft_target_ids,
    draft_vocab_from_ids,
    identity_draft_vocab,
    validate_draft_vocab,
)


def test_hand_counts():
    counts = torch.tensor([5, 0, 3, 3, 9, 1])
    d2t, t2d = build_draft_vocab(counts, 3)
    # most frequent: 4 (9), 0 (5), then the tie 2/3 (3) goes to the lower id 2; sorted by target id
    assert draft_target_ids(d2t).tolist() == [0, 2, 4]
    assert d2t.tolist() == [0, 1, 2] and d2t.dtype == torch.int64
    assert t2d.tolist() == [True, False, True, False, True, False] and t2d.dtype == torch.bool


def test_always_include_takes_precedence():
    counts = torch.tensor([5, 0, 3, 3, 9, 1])
    d2t, t2d = build_draft_vocab(counts, 3, always_include=[5])
    assert draft_target_ids(d2t).tolist() == [0, 4, 5]  # 5 forced in, 2 pushed out
    assert d2t.tolist() == [0, 3, 3]
    d2t, _ = build_draft_vocab(counts, 3, always_include=[1, 5])
    assert draft_target_ids(d2t).tolist() == [1, 4, 5]


def slow_draft_vocab(counts: list[int], size: int, forced=()) -> list[int]:
    order = sorted(range(len(counts)), key=lambda i: (i not in forced, -counts[i], i))
    return sorted(order[:size])


def test_matches_slow_twin_on_random_counts():
    g = torch.Generator().manual_seed(0)
    for trial in range(20):
        V = int(torch.randint(5, 60, (1,), generator=g))
        counts = torch.randint(0, 6, (V,), generator=g)  # many ties
        size = int(torch.randint(1, V + 1, (1,), generator=g))
        forced = sorted(set(torch.randint(0, V, (min(size, 2),), generator=g).tolist()))
        d2t, t2d = build_draft_vocab(counts, size, forced)
        expected = slow_draft_vocab(counts.tolist(), size, forced)
        assert draft_target_ids(d2t).tolist() == expected, trial
        assert t2d.nonzero().flatten().tolist() == expected
        validate_draft_vocab(d2t, t2d)


def test_full_size_is_identity():
    d2t, t2d = build_draft_vocab(torch.tensor([1, 7, 3, 0]), 4)
    assert d2t.tolist() == [0, 0, 0, 0] and bool(t2d.all())
    i_d2t, i_t2d = identity_draft_vocab(4)
    assert torch.equal(d2t, i_d2t) and torch.equal(t2d, i_t2d)


@pytest.mark.parametrize(
    "counts, size, forced, match",
    [
        (torch.tensor([1, 2, 3]), 0, (), "> 0"),
        (torch.tensor([1, 2, 3]), -1, (), "> 0"),
        (torch.tensor([1, 2, 3]), 4, (), "exceeds"),
        (torch.tensor([1, -2, 3]), 2, (), ">= 0"),
        (torch.tensor([[1, 2, 3]]), 2, (), r"\[V\]"),
        (torch.tensor([1, 2, 3]), 2, (3,), "outside"),
        (torch.tensor([1, 2, 3]), 1, (0, 1), "do not fit"),
    ],
)
def test_bad_inputs(counts, size, forced, match):
    with pytest.raises(ValueError, match=match):
        build_draft_vocab(counts, size, forced)


def test_validate_catches_broken_mappings():
    d2t, t2d = draft_vocab_from_ids(torch.tensor([1, 3, 4]), 6)
    assert validate_draft_vocab(d2t, t2d).tolist() == [1, 3, 4]
    # the known bug: an all-zero d2t although the draft tokens are not 0..size-1
    with pytest.raises(ValueError, match="disagree"):
        validate_draft_vocab(torch.zeros(3, dtype=torch.long), t2d)
    # not increasing (two draft ids on the same target id)
    with pytest.raises(ValueError, match="strictly increasing"):
        validate_draft_vocab(torch.tensor([1, 0, 0]), t2d)
    with pytest.raises(ValueError, match="outside"):
        validate_draft_vocab(torch.tensor([1, 2, 9]), t2d)
    with pytest.raises(ValueError, match="marks"):
        bad = t2d.clone()
        bad[0] = True
        validate_draft_vocab(d2t, bad)
    with pytest.raises(ValueError, match="int64"):
        validate_draft_vocab(d2t.int(), t2d)
    with pytest.raises(ValueError, match="bool"):
        validate_draft_vocab(d2t, t2d.long())
    # an all-zero d2t *is* valid when the draft vocab is exactly ids 0..size-1
    zero_t2d = torch.tensor([True, True, True, False, False, False])
    validate_draft_vocab(torch.zeros(3, dtype=torch.long), zero_t2d)


def test_count_tokens_with_mask():
    ids = torch.tensor([[1, 1, 2, 5], [3, 1, 0, 0]])
    mask = torch.tensor([[True, True, False, True], [False, True, True, False]])
    assert count_tokens(ids, 6).tolist() == [2, 3, 1, 1, 0, 1]
    assert count_tokens(ids, 6, mask).tolist() == [1, 3, 0, 0, 0, 1]
