"""Speculative greedy == plain greedy (fp32) for every proposer, family, tree shape and stop rule."""

import pytest
import torch

from drafthead.inference.engine.cache import cache_kwargs, keep_path, new_cache
from drafthead.inference.drafters.draft_model import DraftModelDrafter
from drafthead.inference.drafters.prompt_lookup import PromptLookupDrafter
from drafthead.inference.engine.generate import GenerationConfig, PromptTooLong, speculative_generate
from drafthead.inference.engine.sampling import SamplingConfig
from drafthead.inference.engine.tree import tree_position_ids
from tests.tiny import FAMILIES, plain_greedy, repetitive_prompt, tiny_causal_lm

TREE = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (0, 0, 0, 0)]


def drafters(target, family):
    other = tiny_causal_lm(family, seed=7)
    return {
        "prompt-lookup": PromptLookupDrafter(length=6),
        "prompt-lookup-chain": PromptLookupDrafter(length=4, max_matches=1),
        "prompt-lookup-streak": PromptLookupDrafter(length=3, lookup_streak=12),
        "draft-model-chain": DraftModelDrafter(other, num_draft=3),
        "draft-model-tree": DraftModelDrafter(other, choices=TREE),
        "draft-model-dynamic": DraftModelDrafter(other, num_draft=2, dynamic=True),
        "self-tree": DraftModelDrafter(target, choices=TREE),
    }


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("max_new", [1, 7, 45])
def test_greedy_equals_plain_greedy(family, max_new):
    target = tiny_causal_lm(family)
    prompt = repetitive_prompt(96, seed=max_new)
    reference = plain_greedy(target, prompt, max_new)
    for name, drafter in drafters(target, family).items():
        result = speculative_generate(target, drafter, prompt, GenerationConfig(max_new_tokens=max_new))
        assert result.new_tokens[0].tolist() == reference, (family, name)
        assert result.finish_reason == "length"
        assert sum(result.accepted_lengths) == max_new


def test_eager_attention_gives_the_same_output():
    target = tiny_causal_lm("llama", attn="eager")
    prompt = repetitive_prompt(96, seed=3)
    reference = plain_greedy(target, prompt, 30)
    result = speculative_generate(target, DraftModelDrafter(target, choices=TREE), prompt, GenerationConfig(max_new_tokens=30))
    assert result.new_tokens[0].tolist() == reference


def test_self_draft_accepts_every_token():
    """With the target as its own draft, every drafted token is accepted: tau = depth + 1."""
    target = tiny_causal_lm("llama")
    result = speculative_generate(target, DraftModelDrafter(target, num_draft=4), repetitive_prompt(96), GenerationConfig(max_new_tokens=41))
    assert result.accepted_lengths[:-1] == [5] * 8
    assert result.accepted_lengths[-1] == 1


def test_eos_stops_after_the_eos_token():
    target = tiny_causal_lm("qwen2")
    prompt = repetitive_prompt(96, seed=11)
    reference = plain_greedy(target, prompt, 40)
    eos = reference[9]  # pretend the 10th greedy token is an EOS
    first = reference.index(eos)
    for drafter in (PromptLookupDrafter(), DraftModelDrafter(target, choices=TREE)):
        result = speculative_generate(target, drafter, prompt, GenerationConfig(max_new_tokens=40, eos_token_ids=(eos,)))
        assert result.new_tokens[0].tolist() == reference[: first + 1]
        assert result.finish_reason == "eos"


class CharTokenizer:
    """decode() maps id i to chr(ord('a') + i % 26): enough to exercise stop strings."""

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(ord("a") + i % 26) for i in ids)


def test_stop_string_cuts_after_the_completing_token():
    target = tiny_causal_lm("llama")
    prompt = repetitive_prompt(96, seed=5)
    reference = plain_greedy(target, prompt, 40)
    tok = CharTokenizer()
    stop = tok.decode(reference[12:14])
    text = tok.decode(reference)
    expected_len = text.index(stop) + len(stop)
    result = speculative_generate(
        target, DraftModelDrafter(target, num_draft=5), prompt, GenerationConfig(max_new_tokens=40, stop_strings=(stop,)), tokenizer=tok
    )
    assert result.new_tokens[0].tolist() == reference[:expected_len]
    assert result.finish_reason == "stop_string"


def test_context_limit_is_respected():
    target = tiny_causal_lm("llama")
    prompt = repetitive_prompt(96, seed=2)  # 18 tokens
    reference = plain_greedy(target, prompt, 12)
    result = speculative_generate(
        target, DraftModelDrafter(target, num_draft=5), prompt, GenerationConfig(max_new_tokens=50, max_length=prompt.shape[1] + 12)
    )
    assert result.new_tokens[0].tolist() == reference
    assert result.finish_reason == "context"


def test_streaming_receives_every_token_in_order():
    target = tiny_causal_lm("llama")
    prompt = repetitive_prompt(96)
    pieces = []
    result = speculative_generate(target, PromptLookupDrafter(), prompt, GenerationConfig(max_new_tokens=30), on_tokens=pieces.append)
    assert sum(pieces, []) == result.new_tokens[0].tolist()
    assert [len(p) for p in pieces] == result.accepted_lengths


def test_repetition_penalty_greedy_matches_generate():
    target = tiny_causal_lm("llama")
    prompt = repetitive_prompt(96, seed=4)
    ref = target.generate(prompt, max_new_tokens=30, do_sample=False, repetition_penalty=1.3, eos_token_id=None, pad_token_id=2)
    cfg = GenerationConfig(max_new_tokens=30, sampling=SamplingConfig(repetition_penalty=1.3))
    for drafter in (PromptLookupDrafter(), DraftModelDrafter(target, choices=TREE, sampling=cfg.sampling)):
        result = speculative_generate(target, drafter, prompt, cfg)
        assert result.new_tokens[0].tolist() == ref[0, prompt.shape[1] :].tolist()


def test_bad_inputs_are_clear_errors():
    target = tiny_causal_lm("llama")
    with pytest.raises(ValueError, match="attention_mask"):
        speculative_generate(target, PromptLookupDrafter(), torch.zeros(2, 5, dtype=torch.long), GenerationConfig(), attention_mask=torch.ones(2, 4))
    with pytest.raises(ValueError, match="one prompt at a time"):
        speculative_generate(target, PromptLookupDrafter(), torch.zeros(2, 5, dtype=torch.long), GenerationConfig(), on_tokens=print)
    with pytest.raises(ValueError, match="empty prompt"):
        speculative_generate(target, PromptLookupDrafter(), torch.zeros(1, 0, dtype=torch.long), GenerationConfig())
    with pytest.raises(PromptTooLong):
        speculative_generate(target, PromptLookupDrafter(), torch.zeros(1, 256, dtype=torch.long), GenerationConfig())
    with pytest.raises(ValueError, match="max_new_tokens"):
        GenerationConfig(max_new_tokens=0)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_tree_forward_and_keep_path_equal_recomputation(family):
    """Logits at every tree node equal a plain forward over that node's path, and after
    keep_path the cache equals the cache of the linear sequence (REFERENCE s.2)."""
    target = tiny_causal_lm(family)
    prefix = repetitive_prompt(96, seed=1)
    parents = torch.tensor([-1, 0, 0, 1, 1, 2, 3])
    tokens = torch.tensor([[5, 10, 11, 20, 21, 22, 30]])
    with torch.no_grad():
        cache = new_cache()
        target(prefix, **cache_kwargs(target, cache), use_cache=True)
        past = prefix.shape[1]
        from drafthead.inference.engine.verify import attention_masks

        mask = attention_masks(target.config, parents, past, torch.float32, 1)
        out = target(tokens, attention_mask=mask, position_ids=tree_position_ids(parents, past), **cache_kwargs(target, cache), use_cache=True)
        for node, path in {6: [0, 1, 3, 6], 4: [0, 1, 4], 5: [0, 2, 5]}.items():
            seq = torch.cat([prefix, tokens[:, path]], dim=1)
            ref = target(seq).logits[0, -1]
            torch.testing.assert_close(out.logits[0, node], ref, atol=1e-5, rtol=1e-5)
        keep_path(cache, past, [0, 2, 5])
        linear = new_cache()
        target(torch.cat([prefix, tokens[:, [0, 2, 5]]], dim=1), **cache_kwargs(target, linear), use_cache=True)
        for kept, ref in zip(cache.layers, linear.layers):
            torch.testing.assert_close(kept.keys, ref.keys, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(kept.values, ref.values, atol=1e-5, rtol=1e-5)


class RecordingStreamer:
    """The transformers streamer protocol: put(prompt) first, then new tokens, then end()."""

    def __init__(self):
        self.puts, self.ended = [], False

    def put(self, value):
        self.puts.append(value.flatten().tolist())

    def end(self):
        self.ended = True


def test_transformers_streamer_gets_prompt_then_tokens_then_end():
    target = tiny_causal_lm("llama")
    prompt = repetitive_prompt(96)
    streamer = RecordingStreamer()
    result = speculative_generate(target, PromptLookupDrafter(), prompt, GenerationConfig(max_new_tokens=20), streamer=streamer)
    assert streamer.puts[0] == prompt[0].tolist()
    assert sum(streamer.puts[1:], []) == result.new_tokens[0].tolist()
    assert streamer.ended
