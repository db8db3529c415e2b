"""Trained and untrained heads as drafters: exact greedy output, and the EAGLE drafter's cached,
tree-masked drafting equals a from-scratch recomputation."""

import pytest
import torch

from drafthead.inference.drafters.settings import TreeSettings
from drafthead.heads.registry import build_head, make_config
from drafthead.inference.drafters.head_drafters import EagleDrafter, best_static_tree
from drafthead.inference.engine.generate import GenerationConfig, speculative_generate
from tests.head_checks import KINDS, assert_drafts_match_recomputation, make_drafter, self_generated_batch, train_head
from tests.tiny import plain_greedy, repetitive_prompt, tiny_causal_lm


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_greedy_with_heads_equals_plain_greedy_untrained_and_trained(family, kind):
    target = tiny_causal_lm(family, layers=4)
    head = build_head(make_config(kind, target, None, name="tiny", **KINDS[kind]), target, token_counts=torch.ones(96, dtype=torch.long))
    # the heads memorise the target's continuations of these prompts: trained tau must rise
    prompts = [repetitive_prompt(96, seed=100 + s)[:, :8] for s in (0, 1)]
    refs = [plain_greedy(target, p, 30) for p in prompts]
    for stage in ("untrained", "trained"):
        if stage == "trained":
            head = train_head(head, self_generated_batch(target))
        taus = []
        for prompt, ref in zip(prompts, refs):
            result = speculative_generate(target, make_drafter(head), prompt, GenerationConfig(max_new_tokens=30))
            assert result.new_tokens[0].tolist() == ref, (kind, stage)
            taus.append(result.tau)
        if stage == "trained":
            assert sum(taus) / len(taus) > 1.2, f"{kind} learned nothing: tau {taus}"


def slow_eagle_chain(head, target, history, depth):
    """Greedy chain by recomputing the head over all pairs from scratch at every step."""
    with torch.no_grad():
        hs = target(history[:, :-1], output_hidden_states=True).hidden_states
        fused = head.fuse([hs[i] for i in head.feature_layers])  # [1, L-1, H]
        tokens = history[:, 1:]
        chain = []
        for _ in range(depth):
            h, logits = head.step(fused, tokens, None, None, None)
            draft_id = int(logits[0, -1].argmax())
            token = draft_id if head.draft_to_target is None else draft_id + int(head.draft_to_target[draft_id])
            chain.append(token)
            fused = torch.cat([fused, h[:, -1:]], dim=1)
            tokens = torch.cat([tokens, torch.tensor([[token]])], dim=1)
    return chain


@pytest.mark.parametrize("kind", ["eagle1", "eagle3", "eagle31"])
def test_eagle_drafter_matches_recomputation_across_rounds(kind):
    target = tiny_causal_lm("llama", layers=4)
    head = build_head(make_config(kind, target, None, name="tiny", **KINDS[kind]), target, token_counts=torch.arange(96)).eval()
    drafter = EagleDrafter(head, TreeSettings(num_draft=4, depth=4, branch=1))  # top-1: a chain
    assert_drafts_match_recomputation(target, drafter, lambda history: slow_eagle_chain(head, target, history, 4), repetitive_prompt(96, seed=9))


def test_best_static_tree_prefers_likely_paths():
    acc = torch.tensor([[0.9, 0.05], [0.8, 0.1], [0.5, 0.1]])
    choices = best_static_tree(acc, 4)
    assert choices == [(0,), (0, 0), (0, 0, 0), (0, 1)]  # 0.9, 0.72, 0.36, 0.09 > (1,) 0.05


def drafter_of(folder, target, **settings):
    """The drafter DraftSpec builds for the head folder, with `settings` on top of its drafting.json."""
    from types import SimpleNamespace

    from drafthead.draft_spec import DraftSpec

    return DraftSpec(head=str(folder), **settings).build(SimpleNamespace(name="tiny", model=target, tokenizer=None), note=lambda line: None).factory()


def test_drafting_json_sets_defaults_and_rejects_unknown_keys(tmp_path):
    import json

    from drafthead.inference.drafters.merged import MergedDrafter

    target = tiny_causal_lm("llama", layers=4)
    head = build_head(make_config("eagle1", target, None, name="tiny"), target)
    folder = head.save_pretrained(tmp_path / "head")
    (folder / "drafting.json").write_text(json.dumps({"num_draft": 7, "depth": 2, "lookup_nodes": 3, "lookup_streak": 9}))
    drafter = drafter_of(folder, target)
    assert isinstance(drafter, MergedDrafter)
    assert drafter.drafters[0].num_draft == 7 and drafter.drafters[0].depth == 2
    lookup = drafter.drafters[1]
    assert (lookup.length, lookup.num_draft, lookup.lookup_streak) == (3, 3, 9)
    drafter = drafter_of(folder, target, lookup_streak=0)
    assert drafter.drafters[1].lookup_streak is None  # 0 turns streaks off
    drafter = drafter_of(folder, target, lookup_nodes=0, depth=3)
    assert isinstance(drafter, EagleDrafter) and drafter.depth == 3 and drafter.num_draft == 7
    (folder / "drafting.json").write_text(json.dumps({"total_tokns": 7}))
    with pytest.raises(ValueError, match="total_tokns"):
        drafter_of(folder, target)


@pytest.mark.parametrize(
    "kind, settings, message",
    [
        ("eagle1", {"total_tokens": 5}, "unknown keys ['total_tokens']"),
        ("medusa1", {"num_nodes": 5}, "unknown keys ['num_nodes']"),
        ("eagle1", {"num_draft": "confidence"}, "num_draft (--num-draft) must be a whole number >= 1, got 'confidence'"),
        ("eagle1", {"top_k": 4}, "unknown keys ['top_k']"),  # the tree's branching is `branch`, as --tree-branch
        ("medusa1", {"depth": 3}, "depth (--tree-depth) does not shape a medusa1 head's tree"),
        ("eagle1", {"choices": [[0], [0, 0]]}, "choices does not shape a eagle1 head's tree"),
        ("medusa1", {"sizing": "confidence"}, "sizing 'confidence' sizes EAGLE trees and DSpark blocks; medusa1 heads"),
        ("eagle1", {"lookup_nodes": -1}, "lookup_nodes (--lookup-nodes) must be a whole number >= 0"),
    ],
)
def test_drafting_json_takes_only_the_drafters_own_names(tmp_path, kind, settings, message):
    """drafting.json holds DraftSpec's own names (`num_draft`, `sizing`, `depth`, `branch`,
    `choices`, `lookup_nodes`, `lookup_streak`), checked as the spec checks them and against the
    head's kind: any other key, value or shape is refused naming the file."""
    import json

    target = tiny_causal_lm("llama", layers=4)
    head = build_head(make_config(kind, target, None, name="tiny"), target)
    folder = head.save_pretrained(tmp_path / "head")
    (folder / "drafting.json").write_text(json.dumps(settings))
    with pytest.raises(ValueError) as refused:
        drafter_of(folder, target)
    assert str(folder / "drafting.json") in str(refused.value) and message in str(refused.value)


def slow_eagle_logits(head, target, history, path_tokens):
    """Head logits after the committed pairs and then the draft tokens `path_tokens`, recomputed
    from scratch with a plain causal mask (each draft pair takes its parent's output hidden)."""
    with torch.no_grad():
        hs = target(history[:, :-1], output_hidden_states=True).hidden_states
        fused = head.fuse([hs[i] for i in head.feature_layers])
        tokens = history[:, 1:]
        h, logits = head.step(fused, tokens, None, None, None)
        for token in path_tokens:
            fused = torch.cat([fused, h[:, -1:]], dim=1)
            tokens = torch.cat([tokens, torch.tensor([[token]])], dim=1)
            h, logits = head.step(fused, tokens, None, None, None)
    return logits[0, -1]


def test_eagle_tree_nodes_are_top_k_children_of_their_recomputed_parents():
    """Siblings must not see each other: every drafted node is among the top-k of the logits
    recomputed along its own path alone."""
    target = tiny_causal_lm("llama", layers=4)
    head = build_head(make_config("eagle1", target, None, name="tiny"), target).eval()
    drafter = EagleDrafter(head, TreeSettings(num_draft=30, depth=3, branch=3))
    prompt = repetitive_prompt(96, seed=4)
    with torch.no_grad():
        out = target(prompt[:, :-1], output_hidden_states=True)
    from drafthead.inference.engine.drafter import TargetFeatures

    feats = TargetFeatures(drafter.feature_layers, tuple(out.hidden_states[i] for i in drafter.feature_layers))
    drafter.begin(prompt[:, :-1], feats, prompt[:, -1])
    with torch.inference_mode():
        tree = drafter.propose()
    tokens, parents = tree.tokens[0].tolist(), tree.parents.tolist()
    checked = 0
    for node in range(1, len(tokens)):
        path, p = [], parents[node]
        while p > 0:
            path.append(tokens[p])
            p = parents[p]
        if not path:
            continue
        logits = slow_eagle_logits(head, target, prompt, path[::-1])
        assert tokens[node] in torch.topk(logits, 3).indices.tolist()
        checked += 1
    assert checked >= 6
