"""Merged drafters: the trie union is right, and greedy output stays the target's."""

import torch

from drafthead.inference.drafters.settings import TreeSettings
from drafthead.heads.registry import build_head, make_config
from drafthead.inference.drafters.draft_model import DraftModelDrafter
from drafthead.inference.drafters.head_drafters import EagleDrafter
from drafthead.inference.drafters.merged import MergedDrafter, merge_trees
from drafthead.inference.drafters.prompt_lookup import PromptLookupDrafter
from drafthead.inference.engine.generate import GenerationConfig, speculative_generate
from drafthead.inference.engine.tree import DraftTree
from tests.tiny import plain_greedy, repetitive_prompt, tiny_causal_lm


def test_merge_trees_dedupes_shared_prefixes_and_respects_budgets():
    a = DraftTree(torch.tensor([[9, 1, 2, 3]]), torch.tensor([-1, 0, 1, 0]))  # 9 -> 1 -> 2, 9 -> 3
    b = DraftTree(torch.tensor([[9, 1, 5, 6, 7]]), torch.tensor([-1, 0, 1, 2, 0]))  # 9 -> 1 -> 5 -> 6, 9 -> 7
    merged, maps = merge_trees([a, b], [None, 2])
    # a (no budget) in its own order, then b's new nodes shallowest first
    assert merged.tokens[0].tolist() == [9, 1, 2, 3, 7, 5]
    assert merged.parents.tolist() == [-1, 0, 1, 0, 0, 1]
    assert maps[0] == [0, 1, 2, 3]
    assert maps[1] == [0, 1, 5, -1, 4]  # 6 fell outside b's budget of 2 new nodes


def test_merged_head_and_lookup_and_draft_model_are_exact():
    target = tiny_causal_lm("llama", layers=4)
    head = build_head(make_config("eagle3", target, None, name="tiny", draft_vocab_size=96), target).eval()
    for prompt_seed in (1, 2):
        prompt = repetitive_prompt(96, seed=prompt_seed)
        ref = plain_greedy(target, prompt, 40)
        for drafters in (
            [EagleDrafter(head, TreeSettings(num_draft=8, depth=3, branch=2)), PromptLookupDrafter()],
            [DraftModelDrafter(target, num_draft=2), PromptLookupDrafter(length=6)],
            [PromptLookupDrafter(), DraftModelDrafter(tiny_causal_lm("llama", seed=5), choices=[(0,), (1,), (0, 0)])],
        ):
            result = speculative_generate(target, MergedDrafter(drafters), prompt, GenerationConfig(max_new_tokens=40))
            assert result.new_tokens[0].tolist() == ref
        # uncapped: the lookup drafter caps itself, and grows its chain on a streak
        streaky = MergedDrafter(
            [EagleDrafter(head, TreeSettings(num_draft=6, depth=3, branch=2)), PromptLookupDrafter(length=3, num_draft=3, lookup_streak=10)],
            extra_nodes=None,
        )
        result = speculative_generate(target, streaky, prompt, GenerationConfig(max_new_tokens=40))
        assert result.new_tokens[0].tolist() == ref
