"""Speculative sampling on a tiny model emits tokens distributed exactly as the target's: the
first two tokens' empirical distribution is compared with the enumerated exact one by chi-square."""

import pytest
import torch

from drafthead.inference.drafters.settings import TreeSettings
from drafthead.inference.drafters.draft_model import DraftModelDrafter
from drafthead.inference.drafters.prompt_lookup import PromptLookupDrafter
from drafthead.inference.engine.sampling import SamplingConfig
from tests.law import ALPHA, RUNS, VOCAB, assert_law_at_depth_two, exact_first_two, sampled_first, steered_case
from tests.stats import chi_square_pvalue
from tests.tiny import tiny_causal_lm

# (sampling, draft shape): each draws tests/law.py's COPIES rows a batch (each row its own drafter
# fork and draws); the lookup test below keeps the batch-1 loop's statistical test. A sampled
# chain of 2 at temperature 0.9 is tests/test_batch.py's depth-two case (two prompts of different
# lengths, three tokens).
CASES = {
    "tree-top-p": (SamplingConfig(temperature=1.0, top_p=0.85), dict(choices=[(0,), (1,), (2,), (0, 0), (1, 0)])),
    "chain-top-k": (SamplingConfig(temperature=1.2, top_k=5), dict(num_draft=3)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_draft_model_sampling_is_exact(case):
    sampling, shape = CASES[case]
    target = tiny_causal_lm("llama", vocab=VOCAB, hidden=32, seed=3)
    with torch.no_grad():
        target.lm_head.weight.mul_(0.25)  # undo tiny_causal_lm's sharpening: spread the mass
    draft = tiny_causal_lm("llama", vocab=VOCAB, hidden=32, seed=4)
    prompt = torch.tensor([[3, 4, 5, 3, 4]])
    drafter = DraftModelDrafter(draft, sampling=sampling, seed=0, **shape)
    counts, _ = sampled_first(target, drafter, prompt, sampling, 2)
    assert chi_square_pvalue(counts, exact_first_two(target, prompt, sampling), RUNS) > ALPHA


def test_deterministic_lookup_tree_sampling_is_exact():
    """Batch 1, one sample a call: the plain single-prompt loop under the statistical test too."""
    sampling = SamplingConfig(temperature=0.8)
    target = tiny_causal_lm("llama", vocab=VOCAB, hidden=32, seed=3)
    with torch.no_grad():
        target.lm_head.weight.mul_(0.25)
    prompt = torch.tensor([[3, 4, 5, 6, 3, 4, 7, 6, 3, 4]])  # "3 4" was followed by 5 and by 7
    counts, _ = sampled_first(target, PromptLookupDrafter(length=3), prompt, sampling, 2, copies=1)
    assert chi_square_pvalue(counts, exact_first_two(target, prompt, sampling), RUNS) > ALPHA


# (kind, sampling, lm_head scale): tiny_causal_lm's sharp logits (MIN_DEEP); for the penalty, also a
# strong penalty, so that the law without it is far off (p ~ 1e-21 when checked)
HEAD_CASES = [("eagle3", SamplingConfig(temperature=0.9), 1.0), ("eagle31", SamplingConfig(temperature=1.0, repetition_penalty=3.0), 1.0)]


@pytest.mark.parametrize("kind, sampling, lm_scale", HEAD_CASES)
def test_head_tree_sampling_is_exact_at_depth_two(kind, sampling, lm_scale):
    """An EAGLE head's tree (top-2 children, depth 2): three new tokens, so a path of two drafts
    can be accepted whole; the three tokens' joint law is the target's (with a repetition penalty
    too, which the target and the acceptance apply along each tree path)."""
    from drafthead.heads.registry import build_head, make_config
    from drafthead.inference.drafters.head_drafters import EagleDrafter

    target = tiny_causal_lm("llama", vocab=VOCAB, hidden=32, seed=3, layers=4)
    with torch.no_grad():
        target.lm_head.weight.mul_(lm_scale)
    head = build_head(make_config(kind, target, None, name="tiny", aux_layers=(1, 2, 3)), target).eval()
    prompt = torch.tensor([[3, 4, 5, 3, 4]])
    assert_law_at_depth_two(target, EagleDrafter(head, TreeSettings(num_draft=6, depth=2, branch=2)), prompt, sampling)


@pytest.mark.parametrize("case", ["medusa1", "medusa2", "eagle1", "merged", "policy"])
def test_every_drafter_keeps_the_targets_law_at_depth_two(case):
    target, drafter, policy_of = steered_case(case)
    assert_law_at_depth_two(target, drafter, torch.tensor([[3, 4, 5, 3, 4]]), SamplingConfig(temperature=0.9), policy_of=policy_of)
    if policy_of is not None:
        decisions = policy_of().decisions
        assert any(d > 1 for d in decisions), decisions  # rounds whose trees the policy cut to its node count
