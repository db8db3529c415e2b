"""The load policy on injected costs, steered drafts and its three behaviours (drafts where
drafting pays, decodes plainly where it does not, cuts trees to its count): what
tests/test_policy.py, the negative controls and the llama.cpp backend's tests check it with."""

from __future__ import annotations

import torch

from drafthead.inference.drafters.settings import TreeSettings
from drafthead.heads.registry import build_head, make_config
from drafthead.inference.drafters.head_drafters import EagleDrafter
from drafthead.inference.engine.cost import CostCurve
from drafthead.inference.engine.generate import GenerationConfig, speculative_generate
from drafthead.inference.engine.policy import SpeculationPolicy
from drafthead.inference.engine.sizing import set_policy
from tests.tiny import left_padded, plain_greedy, prompts_of, tiny_causal_lm

FLAT = CostCurve((1, 1024), (0.010, 0.0101))  # a GPU at small batch: more tokens cost nothing
STEEP = CostCurve((1, 16, 64), (0.010, 0.012, 0.048))  # a CPU: flat to 16 tokens, then linear


def under(policy, target, drafter, **fields) -> GenerationConfig:
    """GenerationConfig(**fields) whose rounds of `drafter` on `target` run under `policy` (the
    engine's own otherwise: inference/engine/sizing.py set_policy); None: fixed sizing."""
    if policy is None:
        return GenerationConfig(**fields)
    set_policy(target, drafter, policy)
    return GenerationConfig(sizing="policy", **fields)


def tiny_eagle_drafter():
    """(target, untrained EAGLE-3 head, its drafter: 10 nodes, depth 4, top-3) on a tiny Llama."""
    target = tiny_causal_lm("llama", layers=4)
    head = build_head(make_config("eagle3", target, None, name="tiny", draft_vocab_size=64), target, token_counts=torch.arange(96)).eval()
    return target, head, EagleDrafter(head, TreeSettings(num_draft=10, depth=4, branch=3))


class InjectedCosts(SpeculationPolicy):
    """The policy fed known costs instead of the engine's measured seconds, so what it decides
    depends on the rule and not on the machine's speed: drafting costs `draft_per_row` seconds a
    row, everything outside verify and drafting 1 ms. `drafted` records whether each round drafted
    (a drafter may still return a root-only tree when it drafts)."""

    def __init__(self, *args, draft_per_row: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.draft_per_row = draft_per_row
        self.drafted: list[bool] = []

    def observe(self, sizes, paths, fixed_seconds, draft_seconds, planned=0):
        self.drafted.append(draft_seconds is not None)
        injected = None if draft_seconds is None else self.draft_per_row * len(sizes)
        super().observe(sizes, paths, 0.001, injected, planned)


class RecordedCuts(InjectedCosts):
    """InjectedCosts that keeps each round's cut (the node count every tree is cut to)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.cuts: list[int] = []

    def cut(self, trees):
        keep = super().cut(trees)
        self.cuts.append(keep)
        return keep


def unlimited(oracle):
    """The oracle drafter without `limit`: it drafts its whole tree whatever the policy plans."""
    from tests.oracle import OracleDrafter

    class Unlimited(OracleDrafter):
        limit = None

        def wrap(self, inner, sequence):
            return Unlimited(inner, self.continuation, self.vocab, self.cut, sequence, self.last)

    return Unlimited(oracle.inner, oracle.continuation, oracle.vocab)


def policy_decoding(curve, draft_per_row: float, steered: bool, batch: int = 1, limits: bool = True):
    """(rows, policy) of 40 tokens from an EAGLE-3 tree (10 nodes, depth 4) under the policy on
    injected costs, the drafter's deepest path steered to the target's continuation (tests/oracle.py:
    every draft accepted) or not (an untrained head: nothing accepted). limits False: the drafter
    ignores the policy's num_draft (as prompt lookup and draft models do), so only the cut sizes
    its trees."""
    from tests.oracle import OracleDrafter, known_continuation

    target, head, drafter = tiny_eagle_drafter()
    prompts = prompts_of((9, 14, 5, 11, 7, 12)[:batch], seed=3)
    refs = [plain_greedy(target, p[None], 40) for p in prompts]
    if steered:
        drafter = OracleDrafter(drafter, known_continuation([p.tolist() + r for p, r in zip(prompts, refs)]), 96)
    if not limits:
        drafter = unlimited(drafter)
    policy = RecordedCuts(curve, probe_every=3, draft_per_row=draft_per_row)
    ids, mask = left_padded(prompts)
    out = speculative_generate(target, drafter, ids, under(policy, target, drafter, max_new_tokens=40), attention_mask=mask)
    rows = [out] if batch == 1 else out.rows
    assert [r.new_tokens[0].tolist() for r in rows] == refs
    return rows, policy


def assert_drafts_where_drafting_pays() -> None:
    """Drafts always accepted, verifying more tokens costs nothing, drafting next to nothing: the
    policy drafts in every round and decodes at the tree's depth."""
    rows, policy = policy_decoding(FLAT, 1e-5, steered=True)
    assert all(d > 1 for d in policy.decisions[:-1]), policy.decisions  # the last round has one token left
    assert rows[0].tau >= 2.5, rows[0].accepted_lengths


def assert_plain_where_drafting_does_not_pay() -> None:
    """Drafts never accepted and drafting as dear as a forward, at batch 6 on a CPU-like curve:
    after its first probe the policy decodes plainly, but for sparse probes."""
    _, policy = policy_decoding(STEEP, 0.05, steered=False, batch=6)
    plain = sum(d == 1 for d in policy.decisions)
    assert policy.decisions[0] > 1 and plain >= 0.8 * len(policy.decisions), policy.decisions


def assert_trees_are_cut_to_the_policys_count() -> None:
    """Every drafting round verifies at most the node count the policy's cut chose, in every row."""
    rows, policy = policy_decoding(STEEP, 1e-5, steered=True, batch=3, limits=False)
    drafting = [d for d in range(len(policy.decisions)) if policy.decisions[d] > 1]
    assert len(policy.cuts) == len(drafting) and any(keep < 11 for keep in policy.cuts), policy.cuts
    for row in rows:
        for keep, drafted in zip(policy.cuts, [row.drafted[r] for r in drafting if r < len(row.drafted)]):
            assert drafted + 1 <= keep, (policy.cuts, row.drafted)
