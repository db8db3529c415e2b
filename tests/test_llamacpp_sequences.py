"""The tree -> llama.cpp sequence rules (inference/llamacpp/sequences.py): llama.cpp's own mask
rule over those sequences is exactly the tree's ancestor mask."""

import random

import torch

from drafthead.inference.llamacpp.sequences import leaf_sets, nodes_within, num_leaves, sequence_mask
from drafthead.inference.engine.tree import ancestor_mask


def random_parents(n: int, rng: random.Random) -> list[int]:
    return [-1] + [rng.randrange(i) for i in range(1, n)]


def test_sequence_mask_is_the_ancestor_mask_on_random_trees():
    rng = random.Random(0)
    for n in [1, 2, 3, 5, 8, 17, 40, 64]:
        for _ in range(20):
            parents = random_parents(n, rng)
            expected = ancestor_mask(torch.tensor(parents)).tolist()
            assert sequence_mask(parents) == expected, parents


def test_a_chain_is_one_sequence_and_a_star_one_per_leaf():
    assert leaf_sets([-1, 0, 1, 2]) == [[0], [0], [0], [0]]
    assert leaf_sets([-1, 0, 0, 0]) == [[0, 1, 2], [0], [1], [2]]
    assert leaf_sets([-1, 0, 0, 1, 1]) == [[0, 1, 2], [1, 2], [0], [1], [2]]  # leaves 2, 3, 4


def test_nodes_within_cuts_to_the_longest_prefix_that_fits():
    rng = random.Random(1)
    for _ in range(200):
        parents = random_parents(rng.randrange(1, 30), rng)
        limit = rng.randrange(1, 8)
        k = nodes_within(parents, limit)
        assert num_leaves(parents[:k]) <= limit
        if k < len(parents):
            assert num_leaves(parents[: k + 1]) > limit
    assert nodes_within([-1, 0, 1, 2], 1) == 4  # a chain never needs more than one
    assert nodes_within([-1, 0, 0, 0], 2) == 3
