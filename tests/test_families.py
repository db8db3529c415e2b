"""Every target family of tests/tiny.py through the target side (docs/families.md): it loads
through our loader with an attention that takes tree masks, and its speculative greedy output
equals its plain greedy output in fp32, at B=1 and for ragged rows, in dynamic and static caches.

The targets are tiny random models saved as Hugging Face folders (tests/conftest.py) and read back
with `load_target`, as a user's model would be. Four layers each: Gemma-3 and gpt-oss then hold
two sliding and two full layers, Llama 4 its NoPE full-attention layer (layer 3), DeepSeek-V3 a
dense layer and three MoE layers. Prompts are longer than the windows and chunks (8 positions).
"""
from __future__ import annotations

import logging

import pytest
import torch

from drafthead.inference.drafters.draft_model import DraftModelDrafter
from drafthead.inference.drafters.prompt_lookup import PromptLookupDrafter
from drafthead.inference.generate import GenerationConfig, speculative_generate
from drafthead.inference.verify import check_tree_mask_support
from drafthead.targets import load_target
from tests.test_batch import left_padded
from tests.tiny import FAMILIES, plain_greedy, repetitive_prompt, tiny_causal_lm

LAYERS = 4
NO_SDPA = {"gpt_oss"}  # families transformers runs in eager attention only
TREE = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (0, 0, 0, 0)]
MAX_NEW = 20
RAGGED = (3, 11, 19)  # prompt lengths of the B=3 batch: one inside a window, two past it


@pytest.fixture(scope="module")
def family_target(tiny_target_dir):
    """family -> LoadedTarget of that family's tiny folder, loaded once per module."""
    loaded = {}

    def get(family: str):
        if family not in loaded:
            loaded[family] = load_target(tiny_target_dir(family, layers=LAYERS))
        return loaded[family]

    return get


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_loads_with_an_attention_that_takes_tree_masks(tiny_target_dir, family, caplog):
    with caplog.at_level(logging.WARNING, logger="drafthead.targets"):
        model = load_target(tiny_target_dir(family, layers=LAYERS)).model
    want = "eager" if family in NO_SDPA else "sdpa"
    assert model.config._attn_implementation == want
    check_tree_mask_support(model.config)  # raises for a kernel that ignores 4-D masks
    said = [r.getMessage() for r in caplog.records if "eager" in r.getMessage()]
    assert len(said) == (family in NO_SDPA), said  # one log line when, and only when, sdpa is replaced


def ragged_prompts(vocab: int, seed: int) -> list[torch.Tensor]:
    return [repetitive_prompt(vocab, length=n, seed=seed + n)[0, :n] for n in RAGGED]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_greedy_equals_plain_greedy_in_every_family(family_target, family):
    """B=1: prompt lookup in a dynamic cache, the target drafting for itself in a static one
    (every tree accepted to depth 4: paths move in the cache past windows and chunks). Ragged
    B=3, left-padded: prompt lookup in a static cache, an unrelated draft model of the family in
    a dynamic one (rejections mid-tree)."""
    target = family_target(family).model
    vocab = target.config.vocab_size
    prompt = repetitive_prompt(vocab, length=14, seed=len(family))
    reference = plain_greedy(target, prompt, MAX_NEW)
    for drafter, static in ((PromptLookupDrafter(num_draft=6), False), (DraftModelDrafter(target, choices=TREE), True)):
        result = speculative_generate(target, drafter, prompt, GenerationConfig(max_new_tokens=MAX_NEW, static_cache=static))
        assert result.new_tokens[0].tolist() == reference, (family, type(drafter).__name__)
    assert max(result.accepted_lengths) == 5  # the self-drafted tree was accepted to its full depth

    prompts = ragged_prompts(vocab, seed=len(family))
    references = [plain_greedy(target, p[None], MAX_NEW) for p in prompts]
    ids, mask = left_padded(prompts)
    draft = tiny_causal_lm(family, vocab=vocab, seed=7, layers=2)
    for drafter, static in ((PromptLookupDrafter(num_draft=6), True), (DraftModelDrafter(draft, choices=TREE), False)):
        result = speculative_generate(target, drafter, ids, GenerationConfig(max_new_tokens=MAX_NEW, static_cache=static),
                                      attention_mask=mask)
        assert [row.new_tokens[0].tolist() for row in result.rows] == references, (family, type(drafter).__name__)
