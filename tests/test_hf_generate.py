"""Our heads drafting inside transformers' own `model.generate(...)` through its custom_generate
hook (drafthead/hf_generate.py): the same output as our engine and as plain greedy decoding."""

from types import SimpleNamespace

import pytest
import torch

from drafthead.heads.registry import build_head, make_config
from drafthead.hf_generate import CUSTOM_GENERATE
from drafthead.draft_spec import DraftSpec
from drafthead.inference.engine.generate import GenerationConfig, speculative_generate
from tests.tiny import plain_greedy, repetitive_prompt, tiny_causal_lm

HOOK = {"custom_generate": CUSTOM_GENERATE, "trust_remote_code": True}


def hf_speculative(model, prompt, **kw):
    """transformers' generate() with our loop: the new tokens of each row."""
    out = model.generate(prompt, **HOOK, do_sample=False, eos_token_id=None, pad_token_id=2, **kw)
    return out[:, prompt.shape[1] :]


@pytest.mark.parametrize("kind", ["eagle3", "medusa1"])
def test_a_head_drafts_inside_transformers_generate_exactly(tmp_path, kind):
    target = tiny_causal_lm("llama", layers=2)
    folder = build_head(make_config(kind, target, None, name="tiny"), target).save_pretrained(tmp_path / kind)
    prompt = repetitive_prompt(96, seed=3)
    new = hf_speculative(target, prompt, draft_head=str(folder), max_new_tokens=14, num_draft=6)
    assert new[0].tolist() == plain_greedy(target, prompt, 14)
    drafter = DraftSpec(head=str(folder), num_draft=6).build(SimpleNamespace(name="tiny", model=target, tokenizer=None)).factory()
    ours = speculative_generate(target, drafter, prompt, GenerationConfig(max_new_tokens=14))
    assert new[0].tolist() == ours.new_tokens[0].tolist()
    # every DraftSpec setting by its Python name, `chain` included
    assert hf_speculative(target, prompt, draft_head=str(folder), max_new_tokens=14, chain=3)[0].tolist() == new[0].tolist()


def test_a_ragged_batch_and_prompt_lookup_through_the_hook():
    """No head: prompt lookup drafts. Two left-padded prompts: each row equals its own plain output,
    and generate()'s shape holds (the padded prompts, then the new tokens)."""
    target = tiny_causal_lm("qwen2", layers=2)
    a, b = repetitive_prompt(96, seed=1), repetitive_prompt(96, length=8, seed=2)
    prompt = torch.full((2, a.shape[1]), 2)
    mask = torch.zeros_like(prompt)
    prompt[0], mask[0] = a[0], 1
    prompt[1, -b.shape[1] :], mask[1, -b.shape[1] :] = b[0], 1
    out = target.generate(
        prompt, attention_mask=mask, **HOOK, do_sample=False, eos_token_id=None, pad_token_id=2, max_new_tokens=10, proposer="prompt-lookup"
    )
    assert out.shape == (2, prompt.shape[1] + 10) and torch.equal(out[:, : prompt.shape[1]], prompt)
    assert out[0, prompt.shape[1] :].tolist() == plain_greedy(target, a, 10)
    assert out[1, prompt.shape[1] :].tolist() == plain_greedy(target, b, 10)


def test_what_the_loop_cannot_honour_is_refused_in_one_line():
    target = tiny_causal_lm("llama", layers=1)
    prompt = repetitive_prompt(96)
    for kw, message in (
        ({"num_beams": 2}, "num_beams"),
        ({"return_dict_in_generate": True}, "sequences only"),
        ({"frobnicate": 1}, "does not take frobnicate"),
        ({"sizing": "sometimes"}, "unknown sizing"),
        ({"min_new_tokens": 8}, "does not honour min_new_tokens"),
        ({"no_repeat_ngram_size": 3}, "does not honour no_repeat_ngram_size"),
        ({"do_sample": True, "temperature": 0.0}, "temperature > 0, got temperature=0.0: for greedy decoding set do_sample=False"),
        ({"do_sample": True, "top_p": 0.0}, r"top_p must be in \(0, 1\], got 0.0"),  # read as top_p 1 before
        ({"seed": "abc"}, "seed must be a whole number, got 'abc'"),
        ({"proposer": "prompt-lookup", "draft_head": "h"}, "--head drafts for --proposer head, not prompt-lookup"),
    ):
        with pytest.raises(ValueError, match=message):
            target.generate(prompt, **HOOK, max_new_tokens=4, **kw)
    with pytest.raises(ValueError, match=f"max_length=3 leaves no room for a new token after the {prompt.shape[1]}-token prompt"):
        target.generate(prompt, **HOOK, max_length=3)


def test_a_generation_config_is_read_as_its_keywords_are():
    """Settings given in `generation_config=`: those the loop honours are used, the others refused
    in one line as their keywords are, never ignored."""
    from transformers import GenerationConfig as HFGenerationConfig

    target = tiny_causal_lm("llama", layers=2)
    prompt = repetitive_prompt(96, seed=4)
    given = HFGenerationConfig(max_new_tokens=9, do_sample=False, eos_token_id=None, pad_token_id=2)
    out = target.generate(prompt, **HOOK, generation_config=given, proposer="prompt-lookup")
    assert out[0, prompt.shape[1] :].tolist() == plain_greedy(target, prompt, 9)
    for setting, message in (
        ({"no_repeat_ngram_size": 3}, "does not honour no_repeat_ngram_size=3 (in the generation config)"),
        ({"min_new_tokens": 8}, "does not honour min_new_tokens=8 (in the generation config)"),
        ({"do_sample": True, "temperature": 0.0}, "temperature > 0"),
    ):
        config = HFGenerationConfig(max_new_tokens=4, **setting)
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            target.generate(prompt, **HOOK, generation_config=config)


def test_a_stopping_token_stops_it_where_it_stops_transformers():
    """eos_token_id given to generate(): the output ends at its first occurrence, as plain
    generate()'s does (our loop stops at the same token; the model's own EOS is not added)."""
    target = tiny_causal_lm("llama", layers=2)
    prompt = repetitive_prompt(96, seed=5)
    free = target.generate(prompt, do_sample=False, max_new_tokens=14, eos_token_id=None, pad_token_id=2)[0, prompt.shape[1] :]
    stop = int(free[5])
    plain = target.generate(prompt, do_sample=False, max_new_tokens=14, eos_token_id=stop, pad_token_id=2)
    ours = target.generate(prompt, **HOOK, do_sample=False, max_new_tokens=14, eos_token_id=stop, pad_token_id=2, proposer="prompt-lookup")
    assert ours.tolist() == plain.tolist() and ours.shape[1] <= prompt.shape[1] + 6
