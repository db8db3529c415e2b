"""Images in the prompt of a vision-language target (inference/engine/media.py; docs/families.md
"Images in the prompt"): tiny random Gemma-3, Qwen2.5-VL and Qwen3-VL targets with random images.

Greedy output equals transformers' own generate() given the same images, at batch 1 and for a
ragged batch of 3 whose rows hold images of different grids and one text-only prompt, with prompt
lookup and a draft model, and steered to accept depth >= 2 with rows of different lengths
(tests/oracle.py). The images change the output (decoding without them gives other tokens). A
tree's logits equal a plain forward over the prompt, its image and the path, and the controls
take out each mechanism: Qwen's rope delta, Gemma's image token types.
"""
from __future__ import annotations

import pytest
import torch

from drafthead.inference.drafters.draft_model import DraftModelDrafter
from drafthead.inference.drafters.prompt_lookup import PromptLookupDrafter
from drafthead.inference.engine import media
from drafthead.inference.engine.generate import GenerationConfig, speculative_generate
from drafthead.inference.engine.torch_target import TorchTarget
from drafthead.inference.engine.tree import DraftTree, chain_parents
from tests.oracle import assert_accepts_and_stays_exact
from tests.tiny import (MULTIMODAL, image_prompt, left_padded, plain_greedy_with_images, repetitive_prompt,
                        tiny_causal_lm)

V, NEW = 96, 16
FAMILIES = sorted(MULTIMODAL)
TREE = [[0], [1], [0, 0], [0, 0, 0], [0, 0, 0, 0]]


def ragged_rows(family: str):
    """Three prompts: an image of 4x4 patches, a text-only one, an image of 2x4 patches (Qwen)."""
    rows = [image_prompt(family, text=2, seed=2), (repetitive_prompt(V, length=8, seed=3)[0], None),
            image_prompt(family, text=10, seed=10, grid=(1, 2, 4))]
    return [p for p, _ in rows], [im for _, im in rows]


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_with_an_image_in_the_prompt_equals_plain_greedy(family):
    target = tiny_causal_lm(family, vocab=V, layers=4)
    prompt, images = image_prompt(family)
    reference = plain_greedy_with_images(target, prompt, images, NEW)
    without = speculative_generate(target, PromptLookupDrafter(length=4), prompt[None], GenerationConfig(max_new_tokens=NEW))
    assert without.new_tokens[0].tolist() != reference  # the image matters to the output
    prompts, row_images = ragged_rows(family)
    references = [plain_greedy_with_images(target, p, im, NEW) for p, im in zip(prompts, row_images)]
    ids, mask = left_padded(prompts)
    draft = tiny_causal_lm("llama", vocab=V, seed=7, layers=2)
    for drafter_of in (lambda: PromptLookupDrafter(length=4), lambda: DraftModelDrafter(draft, choices=TREE)):
        result = speculative_generate(target, drafter_of(), prompt[None], GenerationConfig(max_new_tokens=NEW), images=images)
        assert result.new_tokens[0].tolist() == reference
        batched = speculative_generate(target, drafter_of(), ids, GenerationConfig(max_new_tokens=NEW), attention_mask=mask,
                                       images=row_images)
        assert [row.new_tokens[0].tolist() for row in batched.rows] == references
    assert_accepts_and_stays_exact(target, lambda: DraftModelDrafter(draft, choices=TREE), prompt[None], reference, prompts,
                                   references, ids, mask, NEW, NEW, lambda new: GenerationConfig(max_new_tokens=new),
                                   images=images, batch_images=row_images)


def _tree_logits(target, prompts, row_images, paths):
    """The engine's verify logits [B, N, V] for a chain per row (its root, the prompt's last token,
    then `paths[b]`), after a prefill with the images."""
    backend = TorchTarget(target)
    with torch.no_grad():
        backend.start(prompts, (), False, images=row_images)
        trees = [DraftTree(torch.tensor([[int(p[-1])] + path]), chain_parents(len(path))) for p, path in zip(prompts, paths)]
        return backend.verify(trees, [p.numel() - 1 for p in prompts], False).logits


def _full_logits(target, prompt, images, path):
    """A plain forward over prompt + path with the images: logits at the prompt's last token and the path's."""
    kwargs = {"pixel_values": images.pixel_values}
    ids = torch.cat([prompt, torch.tensor(path)])[None]
    types = media.token_types(target.config, ids)
    if images.image_grid_thw is not None:
        kwargs.update(image_grid_thw=images.image_grid_thw, mm_token_type_ids=types)
    else:
        kwargs["token_type_ids"] = types.long()
    with torch.no_grad():
        return target(input_ids=ids, **kwargs).logits[0, prompt.numel() - 1:]


@pytest.mark.parametrize("family", FAMILIES)
def test_tree_logits_after_an_image_equal_a_plain_forward(family, monkeypatch):
    target = tiny_causal_lm(family, vocab=V, layers=4)
    prompts, row_images = ragged_rows(family)
    prompts, row_images = [prompts[0], prompts[2]], [row_images[0], row_images[2]]
    paths = [[5, 6, 7], [8, 9, 10]]
    logits = _tree_logits(target, prompts, row_images, paths)
    for b, (p, im, path) in enumerate(zip(prompts, row_images, paths)):
        torch.testing.assert_close(logits[b, : len(path) + 1], _full_logits(target, p, im, path), atol=1e-5, rtol=1e-4)

    # controls: without Qwen's rope delta, or without Gemma's image token types, the logits move
    if media.uses_mrope(target):
        real = media.prefill_inputs
        monkeypatch.setattr("drafthead.inference.engine.torch_target.prefill_inputs",
                            lambda *a: (real(*a)[0], torch.zeros(len(a[1]), dtype=torch.long)))
    else:
        real = media.prefill_inputs
        monkeypatch.setattr("drafthead.inference.engine.torch_target.prefill_inputs",
                            lambda *a: ({k: v for k, v in real(*a)[0].items() if k != "token_type_ids"}, real(*a)[1]))
    wrong = _tree_logits(target, prompts, row_images, paths)
    gap = max(float((wrong[b, : len(path) + 1] - _full_logits(target, p, im, path)).abs().max())
              for b, (p, im, path) in enumerate(zip(prompts, row_images, paths)))
    assert gap > 1e-3, gap


def test_images_that_do_not_fit_the_prompt_are_refused_in_one_line():
    target = tiny_causal_lm("qwen2_5_vl", vocab=V, layers=2)
    prompt, images = image_prompt("qwen2_5_vl")
    text = repetitive_prompt(V, length=8)[0]
    cases = [
        (text, images, "has images and no image tokens"),
        (prompt, None, "image tokens and no images"),
        (torch.cat([prompt, prompt[3:5]]), images, "ends with an image token"),
    ]
    for ids, im, message in cases:
        with pytest.raises(ValueError, match=message):
            speculative_generate(target, PromptLookupDrafter(), ids[None], GenerationConfig(max_new_tokens=2),
                                 images=[im])
    with pytest.raises(ValueError, match="takes no images"):
        speculative_generate(tiny_causal_lm("llama", vocab=V), PromptLookupDrafter(), text[None],
                             GenerationConfig(max_new_tokens=2), images=[images])
