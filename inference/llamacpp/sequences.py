"""A draft tree as llama.cpp sequences: the pure rules (docs/llamacpp-backend.md).

llama.cpp's KV cache masks by sequence membership and position: a query token of sequences
{s0, ...} at position p sees a cache cell iff the cell belongs to s0 and sits at a position <= p
(llama-kv-cache.cpp, set_input_kq_mask). A tree becomes sequences as follows:

    leaf k of the row's tree             sequence first_leaf + k
    node i                               the sequences of the leaves below it (itself if a leaf),
                                         ascending, so seq_id[0] is one leaf below i
    node i's position                    committed length + depth(i)
    the committed prefix                 copied into every leaf's sequence before the forward

Node i then sees node j iff j lies on the path from the root to leaf seq_id[0] of i (j's leaves
include it) at a depth <= depth(i): exactly i's ancestors and itself. `sequence_mask` applies
llama.cpp's rule to these sets, and the tests check it equals the tree's ancestor mask.
"""

from __future__ import annotations


def children_of(parents: list[int]) -> list[list[int]]:
    kids: list[list[int]] = [[] for _ in parents]
    for i, p in enumerate(parents):
        if p >= 0:
            kids[p].append(i)
    return kids


def depths_of(parents: list[int]) -> list[int]:
    depth = [0] * len(parents)
    for i in range(1, len(parents)):  # topological: a parent comes before its children
        depth[i] = depth[parents[i]] + 1
    return depth


def leaf_sets(parents: list[int]) -> list[list[int]]:
    """[N] lists: for each node, the leaf numbers (0..num_leaves - 1, in node order) below it."""
    kids = children_of(parents)
    leaves = [i for i, k in enumerate(kids) if not k]
    number = {node: k for k, node in enumerate(leaves)}
    below: list[list[int]] = [[] for _ in parents]
    for i in reversed(range(len(parents))):  # children after parents: fill bottom-up
        if not kids[i]:
            below[i] = [number[i]]
        else:
            below[i] = sorted(k for c in kids[i] for k in below[c])
    return below


def num_leaves(parents: list[int]) -> int:
    has_child = [False] * len(parents)
    for p in parents[1:]:
        has_child[p] = True
    return has_child.count(False)


def nodes_within(parents: list[int], max_leaves: int) -> int:
    """The longest prefix of the nodes (a tree, as parents precede children) with at most
    `max_leaves` leaves: a row's tree is cut to it when its sequences would not fit."""
    leaves = 0
    has_child = [False] * len(parents)
    for i, p in enumerate(parents):
        # node i is a new leaf; its parent stops being one the first time it gets a child
        leaves += 1
        if p >= 0 and not has_child[p]:
            has_child[p] = True
            leaves -= 1
        if leaves > max_leaves:
            return i
    return len(parents)


def sequence_mask(parents: list[int]) -> list[list[bool]]:
    """[N][N]: may node i see node j under llama.cpp's rule with this module's sequences."""
    sets = leaf_sets(parents)
    depth = depths_of(parents)
    return [[sets[i][0] in sets[j] and depth[j] <= depth[i] for j in range(len(parents))] for i in range(len(parents))]
