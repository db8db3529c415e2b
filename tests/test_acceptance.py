"""Acceptance rules: hand-made logits with known outcomes, slow twins, and exact distributions."""

from collections import Counter

import pytest
import torch

from drafthead.inference.engine.acceptance import greedy_accept, speculative_sample_chain, tree_rejection_sample
from drafthead.inference.engine.tree import chain_parents
from tests.stats import chi_square_pvalue

ALPHA = 1e-3  # significance of every chi-square test below: a correct rule fails 1 run in 1000

#        0
#      /   \
#     1     2
#    / \     \
#   3   4     5
PARENTS = torch.tensor([-1, 0, 0, 1, 1, 2])


def slow_greedy(tokens, parents, argmax, node=0):
    """Longest path from `node` whose every step equals the target's argmax at its parent
    (siblings may repeat a token, so every matching child is explored)."""
    kids = [c for c in range(len(parents)) if int(parents[c]) == node]
    best = [node]
    for c in kids:
        if int(tokens[c]) == int(argmax[node]):
            sub = slow_greedy(tokens, parents, argmax, c)[0]
            if len(sub) + 1 > len(best):
                best = [node] + sub
    return best, int(argmax[best[-1]])


def test_greedy_rejects_5_accepts_8():
    # chain root -> 8 -> 5: the target wants 8 then 7: accept 8, reject 5, correct to 7
    tokens = torch.tensor([3, 8, 5])
    argmax = torch.tensor([8, 7, 9])
    result = greedy_accept(tokens, chain_parents(2), argmax)
    assert result.path == [0, 1]
    assert result.next_token == 7


def test_greedy_all_accepted_gives_bonus():
    tokens = torch.tensor([3, 8, 7])
    result = greedy_accept(tokens, chain_parents(2), torch.tensor([8, 7, 4]))
    assert result.path == [0, 1, 2] and result.next_token == 4


def test_greedy_picks_the_matching_branch():
    tokens = torch.tensor([0, 10, 11, 20, 21, 22])
    argmax = torch.tensor([11, 0, 22, 0, 0, 6])  # wants 11 at root, then 22 after 11
    result = greedy_accept(tokens, PARENTS, argmax)
    assert result.path == [0, 2, 5] and result.next_token == 6


@pytest.mark.parametrize("seed", range(20))
def test_greedy_matches_slow_walk(seed):
    g = torch.Generator().manual_seed(seed)
    n = 12
    parents = torch.tensor([-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)])
    tokens = torch.randint(0, 3, (n,), generator=g)
    argmax = torch.randint(0, 3, (n,), generator=g)
    result = greedy_accept(tokens, parents, argmax)
    path, nxt = slow_greedy(tokens, parents, argmax)
    # both end on an accepted node of maximal depth; the slow walk takes the first match
    assert len(result.path) == len(path)
    assert all(int(tokens[a]) == int(tokens[b]) for a, b in zip(result.path, path))
    assert result.next_token == int(argmax[result.path[-1]])


def test_chain_sampling_accepts_when_p_dominates_and_corrects_from_residual():
    p = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    q = torch.tensor([[0.0, 1.0, 0.0]])
    n, token = speculative_sample_chain(p, q, torch.tensor([1]))
    assert (n, token) == (1, 2)  # accepted with probability 1, bonus from p_2
    q_bad = torch.tensor([[1.0, 0.0, 0.0]])
    n, token = speculative_sample_chain(p, q_bad, torch.tensor([0]))
    assert (n, token) == (0, 1)  # p(0) = 0: always rejected, residual is p itself


def test_tree_point_mass_rejects_then_renormalises():
    # deterministic children 0 then 1 at the root; p puts no mass on 0 -> never accepted
    p = torch.tensor([[0.0, 0.5, 0.5], [0, 0, 1.0], [1.0, 0, 0]])
    counts = Counter()
    g = torch.Generator().manual_seed(0)
    for _ in range(2000):
        r = tree_rejection_sample(torch.tensor([9, 0, 1]), torch.tensor([-1, 0, 0]), p, None, g)
        counts[(tuple(r.path), r.next_token)] += 1
    assert set(counts) == {((0, 2), 0), ((0,), 2)}  # accept 1 then bonus 0, or reject and emit 2
    assert abs(counts[((0, 2), 0)] / 2000 - 0.5) < 0.05


def exact_two_token_dist(p_root, p_child):
    """P(t1, t2) where t2 follows t1 from p_child[t1]."""
    return {(a, b): float(p_root[a] * p_child[a][b]) for a in range(len(p_root)) for b in range(len(p_root))}


def sampled_tree_case(seed, k_children, vocab=5):
    g = torch.Generator().manual_seed(seed)
    p_root = torch.softmax(torch.randn(vocab, generator=g) * 1.5, 0)
    p_child = torch.softmax(torch.randn(vocab, vocab, generator=g) * 1.5, -1)
    q_root = torch.softmax(torch.randn(vocab, generator=g) * 1.5, 0)
    return p_root, p_child, q_root


@pytest.mark.parametrize("k_children", [1, 3])
def test_tree_rejection_sampling_first_two_tokens_are_exact(k_children):
    """Children drawn without replacement from q; tokens 1-2 must follow the target exactly."""
    vocab, n = 5, 6000
    p_root, p_child, q_root = sampled_tree_case(1, k_children, vocab)
    g = torch.Generator().manual_seed(123)
    counts = Counter()
    for _ in range(n):
        kids = torch.multinomial(q_root, k_children, replacement=False, generator=g)
        tokens = torch.cat([torch.tensor([0]), kids])
        parents = torch.tensor([-1] + [0] * k_children)
        p = torch.cat([p_root[None], p_child[kids]])  # [1 + k, V]
        q = torch.cat([q_root[None], torch.zeros(k_children, vocab)])
        r = tree_rejection_sample(tokens, parents, p, q, g)
        emitted = [int(tokens[i]) for i in r.path[1:]] + [r.next_token]
        if len(emitted) == 1:  # rejected everything: the second token comes from the target
            emitted.append(int(torch.multinomial(p_child[emitted[0]], 1, generator=g)))
        counts[tuple(emitted[:2])] += 1
    assert chi_square_pvalue(counts, exact_two_token_dist(p_root, p_child), n) > ALPHA


def test_tree_rejection_sampling_detects_a_wrong_rule():
    """The test above has power: accepting every sampled child (no correction) fails it."""
    vocab, n = 5, 6000
    p_root, p_child, q_root = sampled_tree_case(1, 1, vocab)
    g = torch.Generator().manual_seed(5)
    counts = Counter()
    for _ in range(n):
        a = int(torch.multinomial(q_root, 1, generator=g))
        b = int(torch.multinomial(p_child[a], 1, generator=g))
        counts[(a, b)] += 1
    assert chi_square_pvalue(counts, exact_two_token_dist(p_root, p_child), n) < ALPHA


def test_chain_rule_first_token_is_exact():
    vocab, n = 6, 8000
    g = torch.Generator().manual_seed(7)
    p = torch.softmax(torch.randn(2, vocab, generator=g) * 2, -1)
    q = torch.softmax(torch.randn(1, vocab, generator=g) * 2, -1)
    counts = Counter()
    for _ in range(n):
        y = torch.multinomial(q[0], 1, generator=g)
        accepted, token = speculative_sample_chain(p, q, y, g)
        counts[int(y) if accepted else token] += 1
    assert chi_square_pvalue(counts, {i: float(p[0, i]) for i in range(vocab)}, n) > ALPHA


# ----------------------------------------------------------------------------- typical (lossy)


def test_typical_accept_known_answers():
    """Root 0 -> node 1 (token 2) -> node 2 (token 3); root -> node 3 (token 1). Thresholds:
    min(eps, delta * exp(-H)). A peaked row demands the likely token; a flat row accepts any."""
    from drafthead.inference.engine.acceptance import TypicalAcceptance, typical_accept

    V = 4
    tokens = torch.tensor([0, 2, 3, 1])
    parents = torch.tensor([-1, 0, 1, 0])
    p = torch.full((4, V), 0.25)  # flat rows: H = log 4, delta*exp(-H) = 0.075 < eps: 0.25 passes
    p[0] = torch.tensor([0.02, 0.03, 0.9, 0.05])  # peaked root: threshold min(0.09, 0.3*exp(-H))
    rule = TypicalAcceptance(epsilon=0.09, delta=0.3)
    out = typical_accept(tokens, parents, p, rule, torch.Generator().manual_seed(0))
    assert out.path == [0, 1, 2]  # token 2 (0.9) typical at the root, token 3 (0.25) at a flat node
    p[1] = torch.tensor([0.97, 0.01, 0.01, 0.01])  # node 1 now confident in token 0: token 3 (0.01) fails
    out = typical_accept(tokens, parents, p, rule, torch.Generator().manual_seed(0))
    assert out.path == [0, 1] and out.next_token == 0  # sampled from p at node 1 (0.97 on token 0 here)
    # H(root) = 0.434, 0.3 * exp(-H) = 0.194: the threshold is eps = 0.09, which neither child
    # (token 2 at 0.03, token 1 at 0.04) reaches; with eps = 0.035 only token 1 passes
    p[0] = torch.tensor([0.9, 0.04, 0.03, 0.03])
    assert typical_accept(tokens, parents, p, rule, torch.Generator().manual_seed(0)).path == [0]
    loose = TypicalAcceptance(epsilon=0.035, delta=0.3)
    assert typical_accept(tokens, parents, p, loose, torch.Generator().manual_seed(0)).path == [0, 3]


def test_typical_acceptance_is_opt_in_and_labelled_lossy():
    from drafthead import GenerationConfig, SamplingConfig, TypicalAcceptance, speculative_generate
    from drafthead.inference.drafters.prompt_lookup import PromptLookupDrafter
    from tests.tiny import repetitive_prompt, tiny_causal_lm

    with pytest.raises(ValueError, match="greedy"):
        GenerationConfig(typical=TypicalAcceptance())
    target = tiny_causal_lm("llama")
    sampling = SamplingConfig(temperature=1.0)
    exact = speculative_generate(
        target, PromptLookupDrafter(length=4), repetitive_prompt(96), GenerationConfig(max_new_tokens=12, sampling=sampling, seed=0)
    )
    lossy = speculative_generate(
        target,
        PromptLookupDrafter(length=4),
        repetitive_prompt(96),
        GenerationConfig(max_new_tokens=12, sampling=sampling, seed=0, typical=TypicalAcceptance()),
    )
    assert not exact.lossy and lossy.lossy and lossy.new_tokens.shape[1] == 12


# ----------------------------------------------------------------------------- the tree rule's exact law


@pytest.mark.parametrize(
    "vocab, branching, with_draft",
    [
        (3, (2, 1), False),
        (4, (2, 2), False),
        (4, (3, 1, 1), False),
        (3, (2, 2), True),
        (4, (2, 1), True),
        (4, (3, 1), True),
        (4, (2, 2), True),
        (5, (2, 1), True),
        (4, (2, 1, 1), True),
    ],
)
def test_tree_rejection_law_is_the_targets_exactly(vocab, branching, with_draft):
    """The law of a round's tokens, computed by enumeration: every draft tree (children drawn from
    the draft without replacement, or fixed), every accept-or-reject branch of the real walk
    (tree_rejection_walk, its draws scripted), continued from the target to depth + 1 tokens,
    equals the target's own law within 1e-9. Sampling tests see a few percent at best; a residual
    left unnormalised after one rejection moves a cell by up to ~0.03 (tests/test_exactness_controls.py).
    Such a slip shows only where, after a rejection, the residual still exceeds the draft on some
    token, which a given pair of laws may never reach: each case runs four seeds."""
    from drafthead.inference.engine.acceptance import tree_rejection_walk
    from tests.law import assert_tree_law_exact

    for seed in range(4):
        assert_tree_law_exact(tree_rejection_walk, vocab, branching, with_draft, seed)
