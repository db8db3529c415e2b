"""The target's law over its first tokens after a prompt, exact and sampled: what every
speculative-sampling test compares (tests/test_sampling_exactness.py and each family's and head
kind's depth-2 cases)."""

from __future__ import annotations

import functools
import itertools
from collections import Counter

import torch

from drafthead.inference.drafters.settings import StaticTreeSettings, TreeSettings
from drafthead.inference.engine.generate import speculative_generate
from drafthead.inference.engine.sampling import SamplingConfig, logits_to_probs
from tests.policy_checks import under
from tests.stats import chi_square_pvalue
from tests.tiny import tiny_causal_lm

ALPHA = 1e-3  # a correct sampler fails each case once in a thousand runs
VOCAB = 8
RUNS = 2500
# Rows drawn per batch call (each row its own drafter fork and draws): per-row work dominates a
# call past ~50 rows on the tiny targets, so more rows per call stop paying.
COPIES = 50
# Rows, of RUNS, whose first round accepted a depth-2 path whole. Drafts steered to the target's
# greedy path (tests/oracle.py) on tiny_causal_lm's sharpened logits give 107-329 across the
# depth-2 tests; at 151 (Medusa's static tree) a residual wrong only at depth 2 reads p ~ 1e-10
# (tests/test_exactness_controls.py). With the LM head flattened 4x, ~100 rows got there and the
# same wrong rule read p ~ 0.02, unseen at ALPHA. Unsteered heads gave as few as one.
MIN_DEEP = 100


def exact_first_two(target, prompt, sampling):
    """P(t1, t2) enumerated from the target's processed distributions."""
    with torch.no_grad():
        p1 = logits_to_probs(target(prompt).logits[0, -1], sampling)
        seqs = torch.cat([prompt.repeat(VOCAB, 1), torch.arange(VOCAB)[:, None]], dim=1)
        p2 = logits_to_probs(target(seqs).logits[:, -1], sampling)
    return {(a, b): float(p1[a] * p2[a, b]) for a in range(VOCAB) for b in range(VOCAB)}


def exact_first_three(target, prompt, sampling):
    """P(t1, t2, t3) enumerated from the target's processed distributions (VOCAB**3 outcomes); a
    repetition penalty sees the prompt and the tokens before each step, as generate() does."""
    from drafthead.inference.engine.sampling import seen_mask

    def probs(seqs):  # [n, L] -> [n, V], the distribution after each sequence
        return logits_to_probs(target(seqs).logits[:, -1], sampling, seen_mask(seqs, VOCAB))

    with torch.no_grad():
        p1 = probs(prompt)[0]  # [V]
        two = torch.cat([prompt.repeat(VOCAB, 1), torch.arange(VOCAB)[:, None]], dim=1)  # [V, P+1]
        p2 = probs(two)  # [V, V]
        pairs = torch.cartesian_prod(torch.arange(VOCAB), torch.arange(VOCAB))  # [V*V, 2]
        three = torch.cat([prompt.repeat(VOCAB * VOCAB, 1), pairs], dim=1)
        p3 = probs(three).view(VOCAB, VOCAB, VOCAB)
    return {(a, b, c): float(p1[a] * p2[a, b] * p3[a, b, c]) for a in range(VOCAB) for b in range(VOCAB) for c in range(VOCAB)}


def assert_static_tree_sampling_exact(drafter_of) -> None:
    """A parallel drafter's static tree (two candidates at depth 1, a child under each) on a tiny
    target: three new tokens, so a depth-2 path can be accepted whole, and
    their joint law must be the target's. drafter_of(target, choices) -> the drafter."""
    sampling = SamplingConfig(temperature=0.9)
    target = tiny_causal_lm("llama", vocab=VOCAB, hidden=32, seed=3, layers=4)
    prompt = torch.tensor([[3, 4, 5, 3, 4]])
    assert_law_at_depth_two(target, drafter_of(target, [(0,), (1,), (0, 0), (1, 0)]), prompt, sampling)


def assert_law_at_depth_two(target, drafter, prompt, sampling, copies: int = COPIES, policy_of=None, chain: bool = False) -> None:
    """The joint law of the first three tokens after `prompt` [1, P] is the target's, with
    `drafter`'s trees steered to the target's greedy path (tests/oracle.py: a deterministic
    draft, so acceptance treats it as a point mass) so that at least MIN_DEEP rows accept a
    depth-2 path whole in their first round. policy_of(): a load policy for each run, or None.
    chain: the trees are cut to their first chain, as a hybrid target verifies them."""
    from tests.oracle import OracleDrafter, greedy_continuation

    steered = OracleDrafter(drafter, greedy_continuation(target), VOCAB, last=False, chain=chain)  # the branch tried first
    counts, deep = sampled_first(target, steered, prompt, sampling, 3, copies=copies, policy_of=policy_of)
    assert deep >= MIN_DEEP, f"{deep} of {RUNS} rows reached depth 2: too few to test the law there"
    assert chi_square_pvalue(counts, exact_first_three(target, prompt, sampling), RUNS) > ALPHA


def sampled_first(target, drafter, prompt, sampling, new_tokens: int, copies: int = COPIES, policy_of=None) -> tuple[Counter, int]:
    """RUNS samples of the first `new_tokens` tokens after `prompt` [1, P], drawn `copies` rows at
    a time in one batch (each row its own drafter fork and draws): the joint counts and how many
    rows accepted a path of new_tokens - 1 drafts whole in their first round."""
    ids = prompt.repeat(copies, 1)
    counts, deep = Counter(), 0
    for run in range(RUNS // copies):
        config = under(None if policy_of is None else policy_of(), target, drafter, max_new_tokens=new_tokens, sampling=sampling, seed=run)
        out = speculative_generate(target, drafter, ids, config, attention_mask=torch.ones_like(ids))
        for row in out.rows if copies > 1 else [out]:
            counts[tuple(row.new_tokens[0].tolist())] += 1
            deep += row.accepted_lengths[0] == new_tokens
    return counts, deep


def steered_case(case: str):
    """(target, drafter, policy_of) of each drafter the README serves that the cases above leave
    out: Medusa-1 and Medusa-2 heads (a static tree), EAGLE-1, the merged drafter a shipped head
    drafts with (an EAGLE-3 tree plus prompt lookup), and the load policy over EAGLE-1's trees
    (injected costs on which drafting pays, so its rounds cut trees and draft)."""
    from drafthead.heads.registry import build_head, make_config
    from drafthead.inference.drafters.head_drafters import EagleDrafter, MedusaDrafter
    from drafthead.inference.drafters.merged import MergedDrafter
    from drafthead.inference.drafters.prompt_lookup import PromptLookupDrafter
    from tests.policy_checks import FLAT, InjectedCosts

    target = tiny_causal_lm("llama", vocab=VOCAB, hidden=32, seed=3, layers=4)
    torch.manual_seed(0)
    if case in ("medusa1", "medusa2"):
        head = build_head(make_config(case, target, None, name="tiny", num_heads=2), target).eval()
        return target, MedusaDrafter(head, StaticTreeSettings(choices=[(0,), (1,), (0, 0), (1, 0)])), None
    eagle1 = EagleDrafter(build_head(make_config("eagle1", target, None, name="tiny"), target).eval(), TreeSettings(num_draft=6, depth=2, branch=2))
    if case == "eagle1":
        return target, eagle1, None
    if case == "policy":  # one policy over every run: its estimates carry over, as they do for a user
        policy = InjectedCosts(FLAT, probe_every=3, draft_per_row=0.00001)
        return target, eagle1, lambda: policy
    eagle3 = build_head(make_config("eagle3", target, None, name="tiny", aux_layers=(1, 2, 3)), target).eval()
    return target, MergedDrafter([EagleDrafter(eagle3, TreeSettings(num_draft=4, depth=2, branch=2)), PromptLookupDrafter(length=3)]), None


# ---------------------------------------------------------------------------------------------- the rule's exact law


def small_laws(vocab: int, depth: int, seed: int, holes: float, keep: int = 1) -> dict[tuple[int, ...], torch.Tensor]:
    """A law [V] (float64) for every token prefix of length 0..depth: the target's (or a
    draft's) next-token distribution after it. A share `holes` of the entries are zero (never the
    `keep` largest), so that drafts the target never takes, residuals that run out and draft laws
    with holes all occur."""
    g = torch.Generator().manual_seed(seed)
    laws = {}
    for n in range(depth + 1):
        for prefix in itertools.product(range(vocab), repeat=n):
            logits = torch.randn(vocab, generator=g, dtype=torch.float64)
            zero = torch.rand(vocab, generator=g) < holes
            zero[torch.topk(logits, keep).indices] = False
            laws[prefix] = torch.softmax(logits.masked_fill(zero, float("-inf")), 0)
    return laws


def ordered_draws(law: torch.Tensor, k: int) -> list[tuple[tuple[int, ...], float]]:
    """Every ordered k-tuple of distinct tokens drawn from `law` without replacement, with its
    probability (how a draft samples a node's children): [(tokens, probability)]."""
    if k == 0:
        return [((), 1.0)]
    out = []
    for x in range(law.shape[0]):
        if float(law[x]) > 0:
            rest = law.clone()
            rest[x] = 0.0
            out += [((x, *more), float(law[x]) * prob) for more, prob in ordered_draws(rest / rest.sum(), k - 1)]
    return out


def draft_trees(branching: tuple[int, ...], vocab: int, draft: dict | None) -> list[tuple[list[int], list[int], list[tuple], float]]:
    """Every draft tree of the shape `branching` (children per node at each depth), nodes in
    breadth-first order, with its probability: [(tokens, parents, each node's token prefix,
    probability)]. `draft` (prefix -> law): each node's children are drawn from its law without
    replacement; None: they are fixed (a top-k), tokens rotated by the node's prefix."""
    trees: list[tuple[list[int], list[int], list[tuple], float]] = [([0], [-1], [()], 1.0)]  # the root: the pending token
    frontier = [0]
    for k in branching:
        grown = []
        for tokens, parents, prefixes, prob in trees:
            options = [
                ordered_draws(draft[prefixes[n]], k) if draft is not None else [(tuple((sum(prefixes[n]) + i) % vocab for i in range(k)), 1.0)]
                for n in frontier
            ]
            for picks in itertools.product(*options):
                t, par, pre, pr = list(tokens), list(parents), list(prefixes), prob
                for node, (kids, pk) in zip(frontier, picks):
                    pr *= pk
                    for x in kids:
                        t.append(x)
                        par.append(node)
                        pre.append(prefixes[node] + (x,))
                grown.append((t, par, pre, pr))
        first = len(trees[0][0])
        trees, frontier = grown, list(range(first, first + len(frontier) * k))
    return trees


def walk_outcomes(walk, tokens, parents, p, q):
    """Every way `walk` (acceptance.tree_rejection_walk) can go on one tree, each accept
    decision taken both ways: [(probability of those decisions, path, law of the token emitted
    after the path)]. The walk is the real one; only its chance moves are scripted."""

    class Fork(Exception):
        pass

    outcomes, scripts = [], [[]]
    while scripts:
        script = scripts.pop()
        weight, step, emitted = 1.0, 0, []

        def accept(probability: float) -> bool:
            nonlocal weight, step
            if step == len(script):  # a decision not taken yet: branch on it (where it can go)
                scripts.extend(script + [d] for d in (True, False) if (probability if d else 1.0 - probability) > 0)
                raise Fork
            decision = script[step]
            step += 1
            weight *= probability if decision else 1.0 - probability
            return decision

        def emit(law: torch.Tensor) -> int:
            emitted.append(law / law.sum())  # what multinomial draws from
            return 0

        try:
            result = walk(tokens, parents, p, q, accept, emit)
        except Fork:
            continue
        outcomes.append((weight, result.path, emitted[0]))
    return outcomes


def assert_tree_law_exact(walk, vocab: int, branching: tuple[int, ...], with_draft: bool, seed: int) -> None:
    """The law of the tokens a tree round emits, continued from the target to depth + 1 tokens,
    computed exactly over every draft tree (children drawn from a draft law without replacement,
    or fixed) and every branch of the walk, equals the target's own law of depth + 1 tokens
    within 1e-9."""
    depth = len(branching)
    target = small_laws(vocab, depth, seed, holes=0.2)
    draft = small_laws(vocab, depth, seed + 100, holes=0.1, keep=max(branching)) if with_draft else None

    @functools.cache
    def continued(prefix: tuple[int, ...]) -> dict[tuple[int, ...], float]:
        """The target's law of `prefix` continued to depth + 1 tokens (prefix -> probability)."""
        out = {}
        for rest in itertools.product(range(vocab), repeat=depth + 1 - len(prefix)):
            prob, seq = 1.0, prefix
            for t in rest:
                prob *= float(target[seq][t])
                seq = seq + (t,)
            out[seq] = prob
        return out

    want = continued(())
    got = dict.fromkeys(want, 0.0)
    for tokens, parents, prefixes, tree_prob in draft_trees(branching, vocab, draft):
        p = torch.stack([target[prefix] for prefix in prefixes])  # [N, V]
        q = torch.stack([draft[prefix] for prefix in prefixes]) if draft is not None else None
        for weight, path, law in walk_outcomes(walk, torch.tensor(tokens), torch.tensor(parents), p, q):
            emitted = prefixes[path[-1]]
            for t in range(vocab):
                if float(law[t]) > 0:
                    for seq, prob in continued(emitted + (t,)).items():
                        got[seq] += tree_prob * weight * float(law[t]) * prob
    worst = max(abs(got[s] - want[s]) for s in want)
    assert worst < 1e-9, f"the round's law differs from the target's by up to {worst:.3g} ({vocab} tokens, branching {branching}, draft {with_draft})"
