"""Tree size from the measured verification cost: the choice rule against a brute-force twin,
the cost curve, and EAGLE drafting sized by confidence staying exact."""

import json
import math
import random
from types import SimpleNamespace

import pytest
import torch

from drafthead.draft_spec import DraftSpec
from drafthead.inference.drafters.settings import TreeSettings
from drafthead.heads.registry import build_head, make_config
from drafthead.inference.engine.cost import CostCurve, best_node_count, measure_verify_cost
from drafthead.inference.drafters.head_drafters import EagleDrafter
from drafthead.inference.drafters.merged import MergedDrafter
from drafthead.inference.drafters.prompt_lookup import PromptLookupDrafter
from drafthead.inference.engine.sizing import set_verify_cost
from drafthead.inference.engine.generate import GenerationConfig, speculative_generate
from tests.tiny import plain_greedy, repetitive_prompt, tiny_causal_lm


def slow_best_node_count(probs, cost, fixed, extra):
    """Every n's expected rate, written out; the smallest n among the best."""
    rates = [(1 + sum(probs[:n])) / (fixed + cost(1 + n + extra)) for n in range(1, len(probs) + 1)]
    best = max(rates)
    return next(n for n, r in enumerate(rates, start=1) if r >= best * (1 - 1e-9))


def test_cost_curve_interpolates_and_extrapolates():
    curve = CostCurve((1, 9, 17), (0.010, 0.014, 0.030))
    assert curve(1) == pytest.approx(0.010) and CostCurve((4, 8), (0.02, 0.03))(1) == pytest.approx(0.02)
    assert curve(5) == pytest.approx(0.012)
    assert curve(13) == pytest.approx(0.022)
    assert curve(25) == pytest.approx(0.046)  # the last slope, 2 ms per node
    with pytest.raises(ValueError):
        CostCurve((8, 1), (0.1, 0.2))
    with pytest.raises(ValueError):
        CostCurve((1,), (0.1,))
    with pytest.raises(ValueError):
        CostCurve((1, 2), (0.0, 0.1))


def test_best_node_count_hand_made():
    flat_then_steep = CostCurve((1, 16, 32), (0.050, 0.055, 0.100))
    # confident draft: every node up to the knee pays, none past it (each node then costs 2.8 ms
    # per 0.05 expected tokens)
    probs = [0.9, 0.8, 0.7] + [0.05] * 40
    assert best_node_count(probs, flat_then_steep, fixed_cost=0.01) == 15
    # a flat curve: keep everything with positive probability
    flat = CostCurve((1, 64), (0.05, 0.05))
    assert best_node_count([0.5] * 10, flat, 0.0) == 10
    # nothing likely: one node (the minimum), ties go to the smaller tree
    assert best_node_count([0.0] * 10, flat, 0.0) == 1
    # extra nodes from another drafter shift the knee left
    assert best_node_count(probs, flat_then_steep, 0.01, extra_nodes=8) == 7
    with pytest.raises(ValueError):
        best_node_count([], flat, 0.0)


def test_best_node_count_matches_brute_force():
    rng = random.Random(0)
    for _ in range(200):
        nodes = sorted(rng.sample(range(1, 80), rng.randint(2, 6)))
        seconds = sorted(rng.uniform(0.01, 0.2) for _ in nodes)
        curve = CostCurve(tuple(nodes), tuple(seconds))
        probs = sorted((rng.random() ** 3 for _ in range(rng.randint(1, 60))), reverse=True)
        fixed, extra = rng.uniform(0, 0.05), rng.randint(0, 8)
        assert best_node_count(probs, curve, fixed, extra) == slow_best_node_count(probs, curve, fixed, extra)


def test_measure_verify_cost_on_a_tiny_target_leaves_no_trace():
    target = tiny_causal_lm("llama", layers=2)
    curve = measure_verify_cost(target, node_counts=(1, 4, 8), context=16, repeats=2)
    assert curve.nodes == (1, 4, 8) and all(s > 0 and math.isfinite(s) for s in curve.seconds)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_confidence_tree_size_is_exact_and_adapts(family):
    target = tiny_causal_lm(family, layers=4)
    head = build_head(make_config("eagle3", target, None, name="tiny", draft_vocab_size=64), target, token_counts=torch.ones(96, dtype=torch.long))
    # a cost that rises steeply after 6 nodes: the drafter must never keep many more
    curve = CostCurve((1, 6, 7, 60), (0.01, 0.011, 0.05, 0.5))
    drafter = EagleDrafter(head, TreeSettings(depth=3, branch=3))
    set_verify_cost(target, drafter, curve)
    sizes = []
    propose = drafter.propose
    drafter.propose = lambda: sizes.append(propose()) or sizes[-1]
    for seed in (0, 1):
        prompt = repetitive_prompt(96, seed=200 + seed)[:, :8]
        result = speculative_generate(target, drafter, prompt, GenerationConfig(max_new_tokens=24, sizing="confidence"))
        assert result.new_tokens[0].tolist() == plain_greedy(target, prompt, 24)
    assert sizes and all(1 <= tree.num_draft <= 7 for tree in sizes)
    assert drafter.accepted_sum > 0 and drafter.predicted_sum > 0  # calibration is being tracked


def test_confidence_sizing_is_the_engines_and_only_for_heads_that_size_themselves(tmp_path):
    """Sizing "confidence" is one setting from the spec to the engine, which hands the drafter the
    verifier's measured cost (inference/engine/sizing.py); a drafter that cannot size itself, a
    head kind that does not, and an unknown rule are refused."""
    target = tiny_causal_lm("llama", layers=2)
    prompt = repetitive_prompt(96, seed=3)[:, :8]
    with pytest.raises(ValueError, match="needs a drafter that sizes its own rounds"):
        speculative_generate(target, PromptLookupDrafter(), prompt, GenerationConfig(max_new_tokens=4, sizing="confidence"))
    with pytest.raises(ValueError, match="unknown sizing 'sometimes'"):
        GenerationConfig(sizing="sometimes")
    head = build_head(make_config("eagle1", target, None, name="tiny"), target)
    folder = head.save_pretrained(tmp_path / "eagle")
    (folder / "drafting.json").write_text(json.dumps({"sizing": "confidence", "depth": 2, "branch": 2, "lookup_nodes": 2}))
    loaded = SimpleNamespace(name="tiny", model=target, tokenizer=None)

    def drafter_of(**settings):
        return DraftSpec(head=str(folder), **settings).build(loaded, note=lambda line: None).factory()

    drafter = drafter_of()
    assert isinstance(drafter, MergedDrafter)
    eagle = drafter.drafters[0]
    assert eagle.confidence_rule and eagle.extra_nodes == 2 and eagle.verify_cost.nodes[0] == 1
    assert eagle.num_draft == 2 + (2 - 1) * 2 * 2  # every candidate of a depth-2, branch-2 tree
    assert not drafter_of(sizing="fixed").drafters[0].confidence_rule
    capped = drafter_of(num_draft=3).drafters[0]
    assert capped.confidence_rule and capped.num_draft == 3  # num_draft caps the rule
    medusa = build_head(make_config("medusa1", target, None, name="tiny"), target)
    medusa_folder = medusa.save_pretrained(tmp_path / "medusa")
    with pytest.raises(ValueError, match="sizing 'confidence' sizes EAGLE trees and DSpark blocks; medusa1 heads"):
        DraftSpec(head=str(medusa_folder), sizing="confidence").build(loaded)
    with pytest.raises(ValueError, match="confidence"):
        DraftSpec(proposer="prompt-lookup", sizing="confidence")
    with pytest.raises(ValueError, match=r"depth \(--tree-depth\) does not shape a medusa1 head's tree"):
        DraftSpec(head=str(medusa_folder), depth=3).build(loaded)
