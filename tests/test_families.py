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
from drafthead.inference.engine.generate import GenerationConfig, speculative_generate
from drafthead.inference.engine.verify import check_tree_mask_support
from drafthead.ground.target.load import load_target
from drafthead.inference.engine.drafter import fork_drafter
from tests.oracle import assert_accepts_and_stays_exact
from tests.tiny import left_padded
from tests.tiny_training import train_three_steps
from tests.tiny import MULTIMODAL, TARGETS, plain_greedy, repetitive_prompt, tiny_causal_lm

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


@pytest.mark.parametrize("family", TARGETS)
def test_every_family_loads_with_an_attention_that_takes_tree_masks(tiny_target_dir, family, caplog):
    with caplog.at_level(logging.WARNING, logger="drafthead.ground.target.load"):
        model = load_target(tiny_target_dir(family, layers=LAYERS)).model
    want = "eager" if family in NO_SDPA else "sdpa"
    assert model.config._attn_implementation == want
    check_tree_mask_support(model.config)  # raises for a kernel that ignores 4-D masks
    said = [r.getMessage() for r in caplog.records if "eager" in r.getMessage()]
    assert len(said) == (family in NO_SDPA), said  # one log line when, and only when, sdpa is replaced


def test_mask_rules_per_layer_type_and_refusals():
    """The pure rule from a config to the tree masks its layers need (inference/engine/verify.py)."""
    from types import SimpleNamespace

    from drafthead.inference.engine.verify import TreeMaskUnsupported, mask_rules

    def config(**kw):
        return SimpleNamespace(_attn_implementation="sdpa", model_type="x", **kw)

    assert mask_rules(config(sliding_window=8)) == {"all": {"sliding_window": 8}}  # Mistral: every layer
    assert mask_rules(config(sliding_window=8, use_sliding_window=False)) == {"all": {"sliding_window": None}}
    chunked = config(layer_types=["chunked_attention"] * 3 + ["full_attention"], attention_chunk_size=8)
    assert mask_rules(chunked) == {"chunked_attention": {"chunk_size": 8}, "full_attention": {}}  # Llama 4
    nested = tiny_causal_lm("gemma3_vlm", layers=2).config  # the rules live in text_config
    assert mask_rules(nested) == {"sliding_attention": {"sliding_window": 8}, "full_attention": {}}
    with pytest.raises(TreeMaskUnsupported, match="layer types linear_attention cannot verify a tree"):
        check_tree_mask_support(config(layer_types=["linear_attention", "full_attention"]))
    with pytest.raises(TreeMaskUnsupported, match="flash_attention_2"):
        check_tree_mask_support(SimpleNamespace(_attn_implementation="flash_attention_2", model_type="x"))


def ragged_prompts(vocab: int, seed: int) -> list[torch.Tensor]:
    return [repetitive_prompt(vocab, length=n, seed=seed + n)[0, :n] for n in RAGGED]


@pytest.mark.parametrize("family", TARGETS)
def test_greedy_equals_plain_greedy_in_every_family(family_target, family):
    """B=1: prompt lookup in a dynamic cache, the target drafting for itself in a static one
    (every tree accepted to depth 4: paths move in the cache past windows and chunks). Ragged
    B=3, left-padded: prompt lookup in a static cache, an unrelated draft model of the family in
    a dynamic one (rejections mid-tree)."""
    target = family_target(family).model
    vocab = target.config.get_text_config().vocab_size
    prompt = repetitive_prompt(vocab, length=14, seed=len(family))
    reference = plain_greedy(target, prompt, MAX_NEW)
    for drafter, static in ((PromptLookupDrafter(length=6), False), (DraftModelDrafter(target, choices=TREE), True)):
        result = speculative_generate(target, drafter, prompt, GenerationConfig(max_new_tokens=MAX_NEW, static_cache=static))
        assert result.new_tokens[0].tolist() == reference, (family, type(drafter).__name__)
    assert max(result.accepted_lengths) == 5  # the self-drafted tree was accepted to its full depth

    prompts = ragged_prompts(vocab, seed=len(family))
    references = [plain_greedy(target, p[None], MAX_NEW) for p in prompts]
    ids, mask = left_padded(prompts)
    draft = tiny_causal_lm(family, vocab=vocab, seed=7, layers=2)
    for drafter, static in ((PromptLookupDrafter(length=6), True), (DraftModelDrafter(draft, choices=TREE), False)):
        result = speculative_generate(target, drafter, ids, GenerationConfig(max_new_tokens=MAX_NEW, static_cache=static), attention_mask=mask)
        assert [row.new_tokens[0].tolist() for row in result.rows] == references, (family, type(drafter).__name__)


def test_llama4_temperature_is_exact_past_its_floor_scale():
    """Llama 4's NoPE layers scale queries by a factor of the position that grows past
    floor_scale - 1 (8191 released; 4 here, so every token is past it). Every node of a tree, in
    rows of a ragged batch, gets the logits a plain forward of its own path gives
    (inference/engine/temperature.py); greedy output is plain decoding's, B=1 and ragged B=3."""
    from drafthead.inference.engine.cache import new_cache, cache_kwargs
    from drafthead.inference.engine.tree import TreeBatch, ancestor_mask, node_depths
    from drafthead.inference.engine.verify import forward_trees

    # every layer NoPE and a strong scale: a wrong factor moves logits by far more than rounding
    target = tiny_causal_lm("llama4", layers=4, floor_scale=4, attn_scale=4.0, no_rope_layers=[0, 0, 0, 0])
    vocab = target.config.vocab_size
    prompts = ragged_prompts(vocab, seed=3)
    parents = torch.tensor([-1, 0, 0, 1, 2, 2, 4])  # node order is not depth order
    tokens = torch.randint(3, vocab, (len(prompts), 7), generator=torch.Generator().manual_seed(0))
    longest = max(p.numel() for p in prompts)
    cache = new_cache()
    padded = torch.zeros(len(prompts), longest, dtype=torch.long)
    for b, p in enumerate(prompts):
        padded[b, : p.numel()] = p
    with torch.inference_mode():
        target(input_ids=padded, **cache_kwargs(target, cache), use_cache=True)
        ancestors = ancestor_mask(parents)[None].expand(len(prompts), 7, 7)
        depths = node_depths(parents)[None].expand(len(prompts), 7)
        lengths = torch.tensor([p.numel() for p in prompts])
        tree = forward_trees(target, cache, TreeBatch(tokens, ancestors, depths, [7] * len(prompts)), lengths, longest, want_hidden=False).logits
        for b, p in enumerate(prompts):
            for node in range(7):
                path = ancestors[b, node].nonzero().flatten()  # root to node: parents come first
                plain = target(torch.cat([p, tokens[b, path]])[None]).logits[0, -1]
                torch.testing.assert_close(tree[b, node], plain, atol=1e-4, rtol=1e-4)

    prompt = repetitive_prompt(vocab, length=14, seed=3)
    reference = plain_greedy(target, prompt, MAX_NEW)
    for static in (False, True):
        result = speculative_generate(
            target, DraftModelDrafter(target, choices=TREE), prompt, GenerationConfig(max_new_tokens=MAX_NEW, static_cache=static)
        )
        assert result.new_tokens[0].tolist() == reference, static
    references = [plain_greedy(target, p[None], MAX_NEW) for p in prompts]
    ids, mask = left_padded(prompts)
    result = speculative_generate(target, DraftModelDrafter(target, choices=TREE), ids, GenerationConfig(max_new_tokens=MAX_NEW), attention_mask=mask)
    assert [row.new_tokens[0].tolist() for row in result.rows] == references


# ---------------------------------------------------------------------------------------------
# Features: the hidden states heads train on
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", TARGETS)
def test_features_of_every_family_online_and_captured(family_target, family, tmp_path):
    """The indices EAGLE-3 and Medusa read exist and hold what they mean: each is the target's
    own hidden state, index L is the LM head's input (logits = lm_head(h_L), soft-capped where
    the family caps, Gemma-3), in the target's dtype and on its device; captured shards hold the
    online values."""
    from drafthead.heads.registry import make_config
    from drafthead.train.capture.features import CapturedFeatures, OnlineFeaturizer, capture_features, collate, required_layers

    model = family_target(family).model
    text = model.config.get_text_config()
    L = text.num_hidden_layers
    layers = sorted({*required_layers(make_config("eagle3", model), L), *required_layers(make_config("medusa1", model), L)})
    assert layers[-1] == L and len(layers) >= 2
    g = torch.Generator().manual_seed(0)
    samples = [
        {"input_ids": torch.randint(3, text.vocab_size - 3, (n,), generator=g), "loss_mask": torch.ones(n, dtype=torch.bool)} for n in (13, 5, 9)
    ]
    batch = collate(samples)
    online = OnlineFeaturizer(model, layers)(batch).hidden_states
    with torch.no_grad():
        full = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, output_hidden_states=True)
        logits = model.lm_head(online[L])
    # Gemma3ForCausalLM soft-caps its logits; Gemma3ForConditionalGeneration, with the same
    # text config, does not (transformers 5.24: docs/families.md "Multimodal targets")
    cap = None if family in MULTIMODAL else getattr(text, "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    real = batch.attention_mask.bool()
    for layer in layers:
        assert online[layer].dtype == model.dtype and online[layer].device == model.device
        torch.testing.assert_close(online[layer][real], full.hidden_states[layer][real], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits[real], full.logits[real], atol=1e-4, rtol=1e-4)

    captured = CapturedFeatures(capture_features(model, samples, layers, tmp_path / "features", batch_size=3).parent)
    for b, sample in enumerate(samples):
        n = len(sample["input_ids"])
        for layer in layers:  # same batch, same order: the same floats
            assert torch.equal(captured[b]["hidden_states"][layer], online[layer][b, :n]), (b, layer)


# ---------------------------------------------------------------------------------------------
# Medusa-1, Medusa-2 and Hydra: trained through `drafthead train`'s builder, then decoding
# ---------------------------------------------------------------------------------------------

HEAD_KINDS = ("medusa1", "medusa2", "hydra")


@pytest.fixture(scope="module")
def chats(tmp_path_factory):
    from drafthead.train.data.tiny import write_tiny_jsonl

    return write_tiny_jsonl(tmp_path_factory.mktemp("chats") / "chats.jsonl", 16)


@pytest.mark.parametrize("kind", HEAD_KINDS)
@pytest.mark.parametrize("family", TARGETS)
def test_medusa_and_hydra_heads_train_and_decode_exactly(tiny_target_dir, family_target, chats, family, kind, tmp_path):
    """Three steps with online features give finite losses; the saved head, loaded back as a user
    would (`load_head_drafter`), decodes its target's (for Medusa-2 the adapted target's) plain
    greedy output at B=1 and for ragged rows. Medusa-2 adapts the target in place, so it gets
    its own copy of the folder's target."""
    import math

    from drafthead.inference.drafters.load import load_head_drafter
    from drafthead.inference.drafters.settings import HeadDrafting, StaticTreeSettings

    folder = tiny_target_dir(family, layers=LAYERS)
    loaded = load_target(folder) if kind == "medusa2" else family_target(family)
    result, losses = train_three_steps(folder, loaded, {"kind": kind, "num_heads": 2}, chats, tmp_path / "run", family)
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses), losses

    fresh = load_target(folder) if kind == "medusa2" else loaded  # the trained run left LoRA layers in its copy
    drafter, target = load_head_drafter(
        result.final_dir,
        fresh.model,
        fresh.tokenizer,
        target_name=family,
        drafting=HeadDrafting(StaticTreeSettings(choices=((0,), (1,), (0, 0), (0, 1), (1, 0)))),
    )
    vocab = target.config.get_text_config().vocab_size
    prompt = repetitive_prompt(vocab, length=14, seed=len(family))
    result = speculative_generate(target, drafter, prompt, GenerationConfig(max_new_tokens=16))
    assert result.new_tokens[0].tolist() == plain_greedy(target, prompt, 16), (family, kind)
    prompts = ragged_prompts(vocab, seed=len(family))
    ids, mask = left_padded(prompts)
    batched = speculative_generate(target, drafter, ids, GenerationConfig(max_new_tokens=16), attention_mask=mask)
    references = [plain_greedy(target, p[None], 16) for p in prompts]
    assert [row.new_tokens[0].tolist() for row in batched.rows] == references
    # the same drafter steered to be accepted (tests/oracle.py): cache moves, ragged rows
    assert_accepts_and_stays_exact(
        target,
        lambda: fork_drafter(drafter),
        prompt,
        plain_greedy(target, prompt, 16),
        prompts,
        references,
        ids,
        mask,
        16,
        16,
        lambda new: GenerationConfig(max_new_tokens=new),
    )


# ---------------------------------------------------------------------------------------------
# Sampling: the emitted law is the target's, at tree depth 2
# ---------------------------------------------------------------------------------------------

# an MoE family and a sliding-window family (window 4: the new tokens' queries at positions 10-12
# cannot see the prompt's first tokens, in the tree as in the reference)
SAMPLED_FAMILIES = {"qwen3_moe": {}, "gemma3": {"sliding_window": 4}}


@pytest.mark.parametrize("family", sorted(SAMPLED_FAMILIES))
def test_tree_sampling_is_exact_at_depth_two(family):
    """Prompt lookup's tree (the prompt's "3 4" was followed by "5 6" and by "7 6": two branches of
    depth 3), its deepest path steered to the target's greedy path (tests/oracle.py), in 50 rows
    of one batch: three new tokens, so a depth-2 path can be accepted whole, and their joint law
    must be the target's, enumerated from plain forwards (tests/law.py).
    Lookup drafts cost nothing, so the samples pay only for the target's forwards. tiny_causal_lm's sharp logits are kept: with them a tree mask that
    ignores Gemma's window moves the law far enough for this test to fail (checked)."""
    from drafthead.inference.engine.sampling import SamplingConfig
    from tests.law import VOCAB, assert_law_at_depth_two

    target = tiny_causal_lm(family, vocab=VOCAB, seed=3, layers=LAYERS, **SAMPLED_FAMILIES[family])
    prompt = torch.tensor([[3, 4, 5, 6, 3, 4, 7, 6, 3, 4]])
    assert_law_at_depth_two(target, PromptLookupDrafter(length=3), prompt, SamplingConfig(temperature=0.6))
