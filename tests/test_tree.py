"""Pure tree functions against slow, obviously-right references and hand-made trees."""

import pytest
import torch

from drafthead.inference.engine.tree import (
    DraftTree,
    ancestor_mask,
    chain_parents,
    node_depths,
    retrieve_indices,
    best_first,
    select_top_nodes,
    tree_attention_mask,
    tree_from_choices,
    tree_position_ids,
)

#        0
#      /   \
#     1     2
#    / \     \
#   3   4     5
#   |
#   6
PARENTS = torch.tensor([-1, 0, 0, 1, 1, 2, 3])


def slow_is_ancestor(parents, i, j):
    while i >= 0:
        if i == j:
            return True
        i = int(parents[i])
    return False


def random_tree(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.tensor([-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)])


def test_depths_hand_made():
    assert node_depths(PARENTS).tolist() == [0, 1, 1, 2, 2, 2, 3]


@pytest.mark.parametrize("seed", range(5))
def test_ancestor_mask_matches_slow_reference(seed):
    parents = random_tree(17, seed)
    mask = ancestor_mask(parents)
    for i in range(17):
        for j in range(17):
            assert bool(mask[i, j]) == slow_is_ancestor(parents, i, j)


def test_attention_mask_layout_and_values():
    past = 3
    mask = tree_attention_mask(PARENTS, past, torch.float32, batch=2)
    assert mask.shape == (2, 1, 7, 10)
    allowed = mask[0, 0] == 0
    assert allowed[:, :past].all()  # every node sees the whole prefix
    assert allowed[6, past:].tolist() == [True, True, False, True, False, False, True]  # 0,1,3,6
    assert allowed[5, past:].tolist() == [True, False, True, False, False, True, False]  # 0,2,5
    assert (mask[0, 0][~allowed] == torch.finfo(torch.float32).min).all()


def test_sliding_window_mask_hides_far_prefix():
    # node 6 sits at position past + 3 = 13; window 4 keeps keys at positions 10..13
    mask = tree_attention_mask(PARENTS, 10, torch.float32, sliding_window=4)[0, 0] == 0
    visible_prefix = mask[6, :10].nonzero().flatten().tolist()
    assert visible_prefix == []  # positions 10 (node 0), 11 (node 1), 12 (node 3) are tree nodes
    assert mask[6, 10:].tolist() == [True, True, False, True, False, False, True]
    mask0 = tree_attention_mask(PARENTS, 10, torch.float32, sliding_window=4)[0, 0] == 0
    assert mask0[0, :10].nonzero().flatten().tolist() == [7, 8, 9]  # root at 10 sees 7, 8, 9


def test_chunked_mask_hides_other_chunks():
    # past 6, chunks of 8: node 0 at position 6 and nodes 1, 2 at 7 are in chunk 0; nodes 3-5 at 8
    # and node 6 at 9 start chunk 1, so they see neither the prefix nor nodes 0-2
    mask = tree_attention_mask(PARENTS, 6, torch.float32, chunk_size=8)[0, 0] == 0
    assert mask[1].tolist() == [True] * 6 + [True, True, False, False, False, False, False]
    assert mask[6].tolist() == [False] * 6 + [False, False, False, True, False, False, True]
    assert mask[4].tolist() == [False] * 6 + [False, False, False, False, True, False, False]


def slow_batch_tree_mask(parents_per_row, prefix_lengths, past_len, window, chunk):
    """One row, one query, one key at a time: row b's node i may see slot s < prefix_lengths[b]
    and its own ancestors, each only within the window and its own chunk."""
    n = max(len(p) for p in parents_per_row)
    allowed = torch.zeros(len(parents_per_row), n, past_len + n, dtype=torch.bool)
    for b, parents in enumerate(parents_per_row):

        def depth(i):
            return 0 if parents[i] < 0 else 1 + depth(parents[i])

        def local(q, k):
            return (window is None or k > q - window) and (chunk is None or k // chunk == q // chunk)

        for i in range(len(parents)):
            q = prefix_lengths[b] + depth(i)
            for s in range(prefix_lengths[b]):
                allowed[b, i, s] = local(q, s)
            j = i
            while j >= 0:
                allowed[b, i, past_len + j] = local(q, prefix_lengths[b] + depth(j))
                j = parents[j]
    return allowed


@pytest.mark.parametrize("window, chunk", [(None, None), (3, None), (None, 4), (5, 4)])
def test_batch_tree_mask_matches_slow_twin(window, chunk):
    from drafthead.inference.engine.tree import batch_tree_mask, pad_trees

    trees = [DraftTree(torch.zeros(1, k, dtype=torch.long), random_tree(k, seed)) for seed, k in enumerate((9, 4, 7))]
    batch = pad_trees(trees)
    lengths = [5, 11, 8]
    mask = batch_tree_mask(batch.ancestors, batch.depths, torch.tensor(lengths), 11, torch.float32, sliding_window=window, chunk_size=chunk)
    want = slow_batch_tree_mask([t.parents.tolist() for t in trees], lengths, 11, window, chunk)
    n = [t.num_nodes for t in trees]
    for b in range(3):  # padded query rows are not compared: their logits are never read
        assert torch.equal((mask[b, 0, : n[b]] == 0), want[b, : n[b]]), b


def test_position_ids_are_prefix_plus_depth():
    assert tree_position_ids(PARENTS, 5).tolist() == [[5, 6, 6, 7, 7, 7, 8]]


def test_retrieve_indices_hand_made():
    rows = {tuple(r) for r in retrieve_indices(PARENTS).tolist()}
    assert rows == {(0, 1, 3, 6), (0, 1, 4, -1), (0, 2, 5, -1)}


@pytest.mark.parametrize("seed", range(3))
def test_retrieve_indices_cover_every_leaf_path(seed):
    parents = random_tree(20, seed)
    rows = retrieve_indices(parents)
    anc = ancestor_mask(parents)
    for row in rows.tolist():
        path = [x for x in row if x >= 0]
        assert path[0] == 0
        for a, b in zip(path, path[1:]):
            assert int(parents[b]) == a
        assert anc[path[-1]].sum() == len(path)


def test_tree_from_choices_medusa_style():
    tree = tree_from_choices([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])
    assert tree.parents.tolist() == [-1, 0, 0, 1, 1, 2, 3]
    assert tree.head.tolist() == [-1, 0, 0, 1, 1, 1, 2]
    assert tree.rank.tolist() == [-1, 0, 1, 0, 1, 0, 0]


def test_tree_from_choices_rejects_orphans():
    with pytest.raises(ValueError, match="no parent"):
        tree_from_choices([(0,), (1, 0)])


def test_draft_tree_validates_topology():
    with pytest.raises(ValueError):
        DraftTree(torch.zeros(1, 3, dtype=torch.long), torch.tensor([-1, 2, 0]))
    with pytest.raises(ValueError):
        DraftTree(torch.zeros(1, 3, dtype=torch.long), torch.tensor([0, 0, 1]))


def test_subtree_renumbers_parents():
    tree = DraftTree(torch.arange(7)[None], PARENTS)
    sub = tree.subtree(torch.tensor([0, 2, 5]))
    assert sub.parents.tolist() == [-1, 0, 1]
    assert sub.tokens.tolist() == [[0, 2, 5]]


def test_select_top_nodes_keeps_best_and_ancestors():
    # cumulative log-probs fall along paths
    scores = torch.tensor([0.0, -0.1, -2.0, -0.3, -0.2, -2.5, -0.4])
    keep = select_top_nodes(PARENTS, scores, num_draft=3)
    assert keep.tolist() == [0, 1, 3, 4]
    keep = select_top_nodes(PARENTS, scores, num_draft=10)
    assert keep.tolist() == list(range(7))


def test_chain_parents():
    assert chain_parents(3).tolist() == [-1, 0, 1, 2]


def test_best_first_order_is_a_tree_at_every_prefix():
    parents = torch.tensor([-1, 0, 0, 1, 1, 2, 3])
    scores = torch.tensor([0.0, -1.0, -0.5, -1.2, -3.0, -0.9, -2.0])
    order = best_first(parents, scores, torch.arange(7))
    assert order.tolist() == [0, 2, 5, 1, 3, 6, 4]  # by score, every parent before its children
    tree = DraftTree(torch.arange(7)[None], parents).subtree(order)
    for n in range(1, 8):  # every prefix is a valid tree
        DraftTree(tree.tokens[:, :n], tree.parents[:n])
    # a child scoring above its parent (non-monotone drafter) waits for the parent
    odd = best_first(parents, torch.tensor([0.0, -2.0, -3.0, -0.1, -4.0, -5.0, -6.0]), torch.arange(7))
    assert odd.tolist()[:3] == [0, 1, 3]
