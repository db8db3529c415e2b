"""Logit processing equals transformers' own processors (so "the target's distribution" means
what `generate(do_sample=True)` samples from)."""

import pytest
import torch
from transformers.generation.logits_process import (
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from drafthead.inference.engine.sampling import SamplingConfig, logits_to_probs, seen_mask


@pytest.mark.parametrize("temperature,top_k,top_p,penalty", [(0.7, 0, 1.0, 1.0), (1.3, 5, 1.0, 1.0), (0.9, 0, 0.8, 1.0), (1.0, 8, 0.6, 1.2)])
def test_matches_transformers_processors(temperature, top_k, top_p, penalty):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 40, generator=g) * 3
    ids = torch.randint(0, 40, (3, 10), generator=g)
    ours = logits_to_probs(logits, SamplingConfig(temperature, top_k, top_p, penalty), seen_mask(ids, 40))
    ref = logits.clone()
    if penalty != 1.0:
        ref = RepetitionPenaltyLogitsProcessor(penalty)(ids, ref)
    ref = TemperatureLogitsWarper(temperature)(ids, ref)
    if top_k:
        ref = TopKLogitsWarper(top_k)(ids, ref)
    if top_p < 1.0:
        ref = TopPLogitsWarper(top_p)(ids, ref)
    torch.testing.assert_close(ours, ref.softmax(-1))


def test_greedy_is_a_point_mass_on_the_argmax():
    logits = torch.tensor([[0.1, 3.0, -1.0]])
    assert logits_to_probs(logits, SamplingConfig()).tolist() == [[0.0, 1.0, 0.0]]


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-2), dict(repetition_penalty=0)])
def test_bad_settings_raise(bad):
    with pytest.raises(ValueError):
        SamplingConfig(**bad)
