"""End to end on the real default target, SmolLM2-135M-Instruct (fp32): speculative greedy output
equals transformers' plain greedy output on MT-bench prompts, for the proposers that need no
training and for an (untrained) EAGLE-3 head, whose tree the verifier must reject correctly."""

import pytest
import torch

from drafthead.inference.drafters.settings import TreeSettings
from drafthead.heads.registry import build_head, make_config
from drafthead.inference.drafters.draft_model import DraftModelDrafter
from drafthead.inference.drafters.head_drafters import EagleDrafter
from drafthead.inference.drafters.prompt_lookup import PromptLookupDrafter
from drafthead.inference.engine.generate import GenerationConfig, speculative_generate
from drafthead.inference.bench.prompts import encode_chat, load_prompts
from drafthead.ground.target.identity import eos_token_ids
from drafthead.ground.target.load import load_target

pytestmark = pytest.mark.slow

NEW_TOKENS = 64


@pytest.fixture(scope="module")
def smollm2():
    loaded = load_target("smollm2-135m", dtype="float32")
    prompts = load_prompts("mt-bench")[::27][:3]  # three categories
    encoded = [encode_chat(loaded.tokenizer, p) for p in prompts]
    eos = eos_token_ids(loaded.model, loaded.tokenizer)
    with torch.no_grad():
        refs = [
            loaded.model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=list(eos), pad_token_id=eos[0])[
                0, ids.shape[1] :
            ].tolist()
            for ids in encoded
        ]
    return loaded, encoded, refs, eos


def test_prompt_lookup_output_is_the_target_greedy_output(smollm2):
    loaded, encoded, refs, eos = smollm2
    for ids, ref in zip(encoded, refs):
        result = speculative_generate(loaded.model, PromptLookupDrafter(), ids, GenerationConfig(max_new_tokens=NEW_TOKENS, eos_token_ids=eos))
        assert result.new_tokens[0].tolist() == ref


def test_untrained_eagle3_head_output_is_the_target_greedy_output(smollm2):
    loaded, encoded, refs, eos = smollm2
    config = make_config("eagle3", loaded.model, loaded.tokenizer, name="smollm2-135m", draft_vocab_size=2048)
    head = build_head(config, loaded.model, token_counts=torch.arange(49152).flip(0)).eval()
    ids, ref = encoded[0], refs[0]
    result = speculative_generate(
        loaded.model,
        EagleDrafter(head, TreeSettings(num_draft=16, depth=4, branch=4)),
        ids,
        GenerationConfig(max_new_tokens=NEW_TOKENS, eos_token_ids=eos),
    )
    assert result.new_tokens[0].tolist() == ref


def test_self_draft_tree_accepts_full_depth(smollm2):
    loaded, encoded, refs, eos = smollm2
    ids, ref = encoded[1], refs[1]
    result = speculative_generate(
        loaded.model, DraftModelDrafter(loaded.model, num_draft=3), ids, GenerationConfig(max_new_tokens=NEW_TOKENS, eos_token_ids=eos)
    )
    assert result.new_tokens[0].tolist() == ref
    assert all(n == 4 for n in result.accepted_lengths[:-1])


def test_batched_shipped_head_rows_equal_the_target_greedy_output(smollm2):
    """The three prompts (of different lengths) in one batch, drafted by the shipped EAGLE-3 head
    with prompt lookup merged in: each row is that prompt's own greedy output."""
    from drafthead.draft_spec import DraftSpec

    loaded, encoded, refs, eos = smollm2
    drafting = DraftSpec(proposer="head").build(loaded, note=lambda line: None)  # the shipped head, its drafting.json
    drafter, target = drafting.factory(), drafting.model
    assert target is loaded.model
    width = max(ids.shape[1] for ids in encoded)
    batch = torch.full((len(encoded), width), eos[0])
    mask = torch.zeros_like(batch)
    for b, ids in enumerate(encoded):
        batch[b, width - ids.shape[1] :], mask[b, width - ids.shape[1] :] = ids[0], 1
    result = speculative_generate(loaded.model, drafter, batch, GenerationConfig(max_new_tokens=NEW_TOKENS, eos_token_ids=eos), attention_mask=mask)
    assert [row.new_tokens[0].tolist() for row in result.rows] == refs
    assert sum(row.tau for row in result.rows) / len(refs) > 1.5  # the head drafts well in the batch too
