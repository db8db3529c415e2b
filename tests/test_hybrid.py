"""Hybrid targets: decoders with linear-attention, state-space or short-convolution layers
(tests/tiny.py HYBRID; inference/engine/hybrid_target.py, docs/trees.md "Hybrid targets").

Each family decodes exactly: fp32 greedy output equals transformers' own greedy generate() at
batch 1 and for a ragged batch of 3 (a one-token prompt among them), with prompt lookup and with a
tree drafter whose trees are cut to chains, steered so that paths of depth >= 2 are accepted and
the rows accept different lengths (tests/oracle.py). Every head kind trains on a hybrid target
through `drafthead train`'s builder and decodes exactly with its head; sampling keeps the target's
law at depth 2. The negative controls take out each mechanism: the per-row rollback, the prefill
without padding (each length apart).
"""

from __future__ import annotations

import math

import pytest
import torch

from drafthead.inference.drafters.draft_model import DraftModelDrafter
from drafthead.inference.drafters.prompt_lookup import PromptLookupDrafter
from drafthead.inference.engine import recurrent
from drafthead.inference.engine.generate import GenerationConfig, speculative_generate
from drafthead.inference.engine.hybrid_target import HybridTarget
from drafthead.inference.engine.recurrent import has_recurrent_layers
from drafthead.ground.target.load import load_target
from drafthead.inference.engine.backend import target_backend
from drafthead.inference.engine.tree import first_chain
from tests.oracle import OracleDrafter, assert_accepts_and_stays_exact, known_continuation
from tests.tiny_training import train_three_steps
from tests.tiny import HYBRID_TARGETS, left_padded, plain_greedy, prompts_of, repetitive_prompt, tiny_causal_lm

V, LAYERS, NEW = 96, 4, 16
TREE = [[0], [1], [0, 0], [0, 1], [0, 0, 0], [0, 0, 0, 0]]


def target_of(family: str):
    return tiny_causal_lm(family, vocab=V, layers=LAYERS)


def test_first_chain_follows_every_depths_first_child():
    parents = torch.tensor([-1, 0, 0, 1, 2, 3, 1])  # 0 -> 1 -> 3 -> 5; 2, 4 and 6 are later branches
    assert first_chain(parents).tolist() == [0, 1, 3, 5]
    assert first_chain(torch.tensor([-1])).tolist() == [0]


@pytest.mark.parametrize("family", HYBRID_TARGETS)
def test_hybrid_targets_get_the_chain_backend(family):
    target = target_of(family)
    assert has_recurrent_layers(target.config)
    assert isinstance(target_backend(target), HybridTarget)
    with pytest.raises(ValueError, match="recurrent layers"):
        target_backend(target, static_cache=True)
    with pytest.raises(ValueError, match="draft model with recurrent layers"):
        DraftModelDrafter(target)
    from drafthead.inference.llamacpp.target import LlamaCppError, LlamaCppTarget

    with pytest.raises(LlamaCppError, match="has recurrent layers.*torch backend"):  # before libllama or the GGUF loads
        LlamaCppTarget("model.gguf", target.config)
    assert not has_recurrent_layers(tiny_causal_lm("llama").config)


@pytest.mark.parametrize("family", HYBRID_TARGETS)
def test_greedy_equals_plain_greedy_in_every_hybrid_family(family):
    """Prompt lookup, and an unrelated attention-only draft model's trees (cut to chains), at B=1
    and ragged B=3; then the draft model's steered to be accepted to depth >= 2 with rows of
    different lengths (prompt lookup drafts nothing once no n-gram matches, so it is not steered)."""
    target = target_of(family)
    prompt = repetitive_prompt(V, length=14, seed=len(family))
    reference = plain_greedy(target, prompt, NEW)
    prompts = prompts_of((1, 6, 13), seed=2)
    references = [plain_greedy(target, p[None], NEW) for p in prompts]
    ids, mask = left_padded(prompts)
    draft = tiny_causal_lm("llama", vocab=V, seed=7, layers=2)
    for drafter_of in (lambda: PromptLookupDrafter(length=6), lambda: DraftModelDrafter(draft, choices=TREE)):
        result = speculative_generate(target, drafter_of(), prompt, GenerationConfig(max_new_tokens=NEW))
        assert result.new_tokens[0].tolist() == reference, family
        batched = speculative_generate(target, drafter_of(), ids, GenerationConfig(max_new_tokens=NEW), attention_mask=mask)
        assert [row.new_tokens[0].tolist() for row in batched.rows] == references, family
    assert_accepts_and_stays_exact(
        target, drafter_of, prompt, reference, prompts, references, ids, mask, NEW, NEW, lambda new: GenerationConfig(max_new_tokens=new), chain=True
    )


@pytest.mark.parametrize("family", ["qwen3_next", "lfm2"])
def test_discard_puts_every_row_back_to_its_state_before_the_verify(family):
    """What the cost timing (`--sizing policy`) does after each timed verify: the recurrent
    windows and states of every row are those before it, the K/V cut back."""
    from drafthead.inference.engine.recurrent import recurrent_layers
    from drafthead.inference.engine.tree import DraftTree, chain_parents

    backend = HybridTarget(target_of(family))
    prompts = prompts_of((6, 9), seed=1)
    with torch.no_grad():
        backend.start(prompts, (), False)

        def states():
            return [
                t.clone()
                for layer in recurrent_layers(backend.cache)
                for t in (*layer.conv_states.values(), *layer.recurrent_states.values())
                if t is not None
            ]

        before = states()
        trees = [DraftTree(torch.tensor([[int(p[-1]), 5, 6, 7]]), chain_parents(3)) for p in prompts]
        backend.verify(trees, [p.numel() - 1 for p in prompts], False)
        backend.discard(8)
    after = states()
    assert len(after) == len(before) and all(torch.equal(a, b) for a, b in zip(after, before))


def loud_recurrence(family: str = "qwen3_next"):
    """A tiny target whose linear-attention layers write 8x more into the residual stream, so that
    a wrong recurrent state shows in the greedy tokens (at 1x it moves the logits ~20% and seldom
    the argmax)."""
    target = target_of(family)
    with torch.no_grad():
        for layer in target.model.layers:
            if hasattr(layer, "linear_attn"):
                layer.linear_attn.out_proj.weight.mul_(8.0)
    return target


@pytest.mark.parametrize("family", HYBRID_TARGETS)
def test_prompts_of_one_token_start_from_empty_states(family):
    """Nothing to prefill: the first verify forward creates the recurrent states, and its chain of
    6 nodes (longer than any convolution window) keeps its accepted part, at B=1 and B=2."""
    target = target_of(family)
    draft = tiny_causal_lm("llama", vocab=V, seed=7, layers=2)
    prompts = torch.tensor([[5], [9]])
    chain = [[0] * d for d in range(1, 6)]
    for ids in (prompts[:1], prompts):
        result = speculative_generate(
            target, DraftModelDrafter(draft, choices=chain), ids, GenerationConfig(max_new_tokens=10), attention_mask=torch.ones_like(ids)
        )
        rows = result.rows if ids.shape[0] > 1 else [result]
        assert [row.new_tokens[0].tolist() for row in rows] == [plain_greedy(target, p[None], 10) for p in ids]


@pytest.mark.parametrize("family", ["qwen3_next", "granitemoehybrid"])
def test_prompts_of_one_length_prefill_together_in_the_prompts_order(family):
    """Rows of repeated lengths (one prefill forward per length, then put back in the prompts'
    order): each row's prefill states are those of the row alone, and its output is its own plain
    greedy output, with drafts accepted to depth >= 2."""
    target = target_of(family)
    prompts = prompts_of((6, 13, 6, 1, 13), seed=4)
    with torch.no_grad():
        together = target_backend(target).start(prompts, feature_layers=(1, 2), need_last=True)
        for b, p in enumerate(prompts):
            alone = target_backend(target).start([p], feature_layers=(1, 2), need_last=True)
            n = p.numel() - 1
            for mixed, own in zip(together, alone or [None] * len(together)):
                assert not mixed[b, n:].any(), (b, "past the row's end: zeros")
                if own is not None:
                    torch.testing.assert_close(mixed[b, :n], own[0], rtol=1e-5, atol=1e-6, msg=f"row {b}")
    references = [plain_greedy(target, p[None], NEW) for p in prompts]
    ids, mask = left_padded(prompts)
    sequences = [p.tolist() + ref for p, ref in zip(prompts, references)]
    draft = tiny_causal_lm("llama", vocab=V, seed=7, layers=2)
    steered = OracleDrafter(DraftModelDrafter(draft, choices=TREE), known_continuation(sequences), V, chain=True)
    result = speculative_generate(target, steered, ids, GenerationConfig(max_new_tokens=NEW), attention_mask=mask)
    assert [row.new_tokens[0].tolist() for row in result.rows] == references
    assert all(max(row.accepted_lengths) >= 3 for row in result.rows)  # every row accepted 2 drafts or more in a round


def _steered_ragged(target):
    prompts = prompts_of((1, 6, 13), seed=2)
    references = [plain_greedy(target, p[None], NEW) for p in prompts]
    ids, mask = left_padded(prompts)
    prompt = repetitive_prompt(V, length=14, seed=1)
    draft = tiny_causal_lm("llama", vocab=V, seed=7, layers=2)
    assert_accepts_and_stays_exact(
        target,
        lambda: DraftModelDrafter(draft, choices=TREE),
        prompt,
        plain_greedy(target, prompt, NEW),
        prompts,
        references,
        ids,
        mask,
        NEW,
        NEW,
        lambda new: GenerationConfig(max_new_tokens=new),
        chain=True,
    )


def test_negative_control_one_rollback_for_the_whole_batch_is_not_exact(monkeypatch):
    """Every row set back to the longest row's accepted count, as a batch-wide crop does: the ragged
    rows' states run ahead of their tokens, and the output changes."""
    target = loud_recurrence()
    _steered_ragged(target)  # exact as built
    keep = recurrent.keep_states
    monkeypatch.setattr("drafthead.inference.engine.hybrid_target.keep_states", lambda cache, accepted: keep(cache, [max(accepted)] * len(accepted)))
    with pytest.raises(AssertionError):
        _steered_ragged(target)


def test_negative_control_a_right_padded_prefill_is_not_exact(monkeypatch):
    """One batched prefill, right-padded as for attention-only targets: the padding runs into the
    short rows' recurrent states."""
    target = loud_recurrence()
    _steered_ragged(target)  # exact as built

    def batched_start(self, prompts, feature_layers, need_last, max_new_tokens=0):
        longest = max(p.numel() for p in prompts)
        self.slots = longest - 1
        self.cache = recurrent.hybrid_cache(self.model.config)
        padded = torch.zeros(len(prompts), self.slots, dtype=torch.long)
        for b, p in enumerate(prompts):
            padded[b, : p.numel() - 1] = p[:-1]
        self.model(input_ids=padded, cache=self.cache, use_cache=True)
        return None

    monkeypatch.setattr(HybridTarget, "start", batched_start)
    with pytest.raises(AssertionError):
        _steered_ragged(target)


@pytest.mark.parametrize("family", ["qwen3_next", "granitemoehybrid"])
def test_chain_sampling_is_exact_at_depth_two(family):
    """Prompt lookup's tree cut to its first chain, steered to the target's greedy path: the joint
    law of three new tokens (a depth-2 chain accepted whole in many rows) is the target's."""
    from drafthead.inference.engine.sampling import SamplingConfig
    from tests.law import VOCAB, assert_law_at_depth_two

    target = tiny_causal_lm(family, vocab=VOCAB, seed=3, layers=LAYERS)
    prompt = torch.tensor([[3, 4, 5, 6, 3, 4, 7, 6, 3, 4]])
    assert_law_at_depth_two(target, PromptLookupDrafter(length=3), prompt, SamplingConfig(temperature=0.6), chain=True)


# ---------------------------------------------------------------------------------------------
# Every head kind: trained through `drafthead train`'s builder, then decoding with its head
# ---------------------------------------------------------------------------------------------

HEADS = {
    "medusa1": {"num_heads": 2},
    "medusa2": {"num_heads": 2},
    "hydra": {"num_heads": 2},
    "eagle1": {},
    "eagle3": {"draft_vocab_size": 64, "ttt_steps": 2},
    "eagle31": {"draft_vocab_size": 64, "ttt_steps": 2},
    "peagle": {"draft_vocab_size": 64, "parallel_depth": 3},
    "dflash": {"block_size": 4, "num_anchors": 4},
    "dspark": {"block_size": 4, "num_anchors": 4, "markov_rank": 8},
}


SSM = {"mamba", "mamba2", "falcon_mamba"}  # no attention layer at all


@pytest.fixture(scope="module")
def chats(tmp_path_factory):
    from drafthead.train.data.tiny import write_tiny_jsonl

    return write_tiny_jsonl(tmp_path_factory.mktemp("chats") / "chats.jsonl", 16)


@pytest.mark.parametrize("kind", sorted(HEADS))
@pytest.mark.parametrize("family", HYBRID_TARGETS)
def test_every_head_kind_trains_on_a_hybrid_target_and_decodes_exactly(tiny_target_dir, chats, family, kind, tmp_path):
    """Three steps with online features give finite losses; the saved head, loaded as a user would,
    decodes plain greedy output at B=1 and, steered, accepts depth >= 2 and ragged lengths. A NoPE
    target refuses the kinds whose draft layer copies the target's RoPE layer, in one line."""
    from drafthead.heads.eagle import has_rope_decoder
    from drafthead.heads.registry import HEAD_CLASSES

    from drafthead.inference.drafters.load import load_head_drafter

    folder = tiny_target_dir(family, layers=LAYERS)
    loaded = load_target(folder)
    head = {"kind": kind, **HEADS[kind]}
    if kind in ("peagle", "dflash", "dspark"):  # a token id whose embedding row is not the padding's zero row
        head["mask_token_id"] = len(loaded.tokenizer) - 1
    if HEAD_CLASSES[kind].needs_rope_decoder and not has_rope_decoder(loaded.model):  # NoPE: Jamba, Mamba, ...
        with pytest.raises(ValueError, match=f"a {kind} head builds its draft layers from the target's RoPE decoder layer"):
            from drafthead.heads.registry import make_config

            make_config(kind, loaded.model, loaded.tokenizer)
        return
    # Medusa-2's LoRA: a state-space model has no attention projections, so its mixer's input
    # projection (peft refuses LoRA on a Mamba out_proj)
    lora = {"lora": {"target_modules": ["in_proj"]}} if kind == "medusa2" and family in SSM else {}
    result, losses = train_three_steps(folder, loaded, head, chats, tmp_path / "run", family, **lora)
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses), losses

    fresh = load_target(folder) if kind == "medusa2" else loaded  # the trained run left LoRA layers in its copy
    drafter, target = load_head_drafter(result.final_dir, fresh.model, fresh.tokenizer, target_name=family)
    vocab = target.config.get_text_config().vocab_size
    prompt = repetitive_prompt(vocab, length=14, seed=len(family))
    reference = plain_greedy(target, prompt, NEW)
    assert speculative_generate(target, drafter, prompt, GenerationConfig(max_new_tokens=NEW)).new_tokens[0].tolist() == reference
    prompts = prompts_of((1, 6, 13), seed=2)
    references = [plain_greedy(target, p[None], NEW) for p in prompts]
    ids, mask = left_padded(prompts)
    batched = speculative_generate(target, drafter, ids, GenerationConfig(max_new_tokens=NEW), attention_mask=mask)
    assert [row.new_tokens[0].tolist() for row in batched.rows] == references
    from drafthead.inference.engine.drafter import fork_drafter

    assert_accepts_and_stays_exact(
        target,
        lambda: fork_drafter(drafter),
        prompt,
        reference,
        prompts,
        references,
        ids,
        mask,
        NEW,
        NEW,
        lambda new: GenerationConfig(max_new_tokens=new),
        chain=True,
    )
