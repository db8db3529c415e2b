"""The target's linears dispatched by row count inside the engine (inference/target_linears.py)."""
import pytest
import torch
from torch import nn

from drafthead.inference import target_linears
from drafthead.inference.drafters.draft_model import DraftModelDrafter
from drafthead.inference.drafters.prompt_lookup import PromptLookupDrafter
from drafthead.inference.generate import GenerationConfig, speculative_generate
from drafthead.inference.target_linears import ROW_BUCKETS, RowDispatchLinear, engine_linears, fits_in_memory, kernel_for_rows
from tests.test_batch import left_padded, prompts_of
from tests.tiny import FAMILIES, plain_greedy, repetitive_prompt, tiny_causal_lm

PACKING = torch.backends.mkldnn.is_available()
TREE = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1)]


def test_the_smallest_bucket_at_or_above_the_row_count_decides():
    wins = (False, False, True, True, True, False, False, True)  # buckets 1, 2, 4, ... 128
    assert [kernel_for_rows(r, wins) for r in (1, 2, 3, 4, 5, 16, 17, 33, 64, 65, 128)] == [
        "plain", "plain", "packed", "packed", "packed", "packed", "plain", "plain", "plain", "packed", "packed"]
    assert kernel_for_rows(129, wins) == "plain"  # past the last bucket: MKL's regime
    assert kernel_for_rows(4000, (True,) * len(ROW_BUCKETS)) == "plain"


def test_packed_copies_are_made_only_where_they_fit():
    gib = 1 << 30
    assert fits_in_memory(540 << 20, 24 * gib)  # SmolLM2's fp32 linears on this machine
    assert not fits_in_memory(32 * gib, 64 * gib)  # an 8B target's on a 64 GB machine
    assert fits_in_memory(32 * gib, None)  # memory unknown: pack


@pytest.fixture
def packed_everywhere(monkeypatch):
    """Every layer takes the packed kernel at every measured row count, whatever this CPU's
    timings say, so the tests exercise that path on tiny shapes too."""
    monkeypatch.setattr(target_linears, "calibrate", lambda linear, packed: (True,) * len(ROW_BUCKETS))


def _linear_types(model) -> set[type]:
    return {type(m) for m in model.modules() if isinstance(m, (nn.Linear, RowDispatchLinear))}


@pytest.mark.skipif(not PACKING, reason="this torch build has no oneDNN")
def test_the_swap_lasts_only_the_block_and_leaves_the_state_dict(packed_everywhere):
    target = tiny_causal_lm("llama")
    keys = list(target.state_dict())
    with engine_linears(target):
        assert _linear_types(target) == {RowDispatchLinear}
        assert list(target.state_dict()) == keys
        with engine_linears(target):  # nested: the outer swap stands
            assert _linear_types(target) == {RowDispatchLinear}
        assert _linear_types(target) == {RowDispatchLinear}
    assert _linear_types(target) == {nn.Linear}
    assert list(target.state_dict()) == keys
    with engine_linears(target, enabled=False):
        assert _linear_types(target) == {nn.Linear}


@pytest.mark.skipif(not PACKING, reason="this torch build has no oneDNN")
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_greedy_with_packed_target_linears_equals_plain_greedy(family, packed_everywhere):
    target = tiny_causal_lm(family, layers=3)
    prompt = repetitive_prompt(96, seed=5)
    reference = plain_greedy(target, prompt, 40)
    for drafter in (DraftModelDrafter(tiny_causal_lm(family, seed=7), choices=TREE), PromptLookupDrafter(num_draft=6)):
        result = speculative_generate(target, drafter, prompt, GenerationConfig(max_new_tokens=40))
        assert result.new_tokens[0].tolist() == reference, family
    # and at batch 3, prompts of different lengths: every row is its prompt's own plain output
    prompts = prompts_of((4, 11, 19), seed=3)
    ids, mask = left_padded(prompts)
    batched = speculative_generate(target, DraftModelDrafter(target, choices=TREE), ids,
                                   GenerationConfig(max_new_tokens=24), attention_mask=mask)
    assert [row.new_tokens[0].tolist() for row in batched.rows] == [plain_greedy(target, p[None], 24) for p in prompts]


@pytest.mark.skipif(not PACKING, reason="this torch build has no oneDNN")
def test_packed_copies_follow_an_in_place_weight_change(packed_everywhere):
    """load_state_dict writes into the same storage: a stale packed copy would decode the old model."""
    target = tiny_causal_lm("qwen2")
    prompt = repetitive_prompt(96, seed=2)
    drafter = PromptLookupDrafter(num_draft=6)
    speculative_generate(target, drafter, prompt, GenerationConfig(max_new_tokens=8))  # packs the weights
    other = tiny_causal_lm("qwen2", seed=3)
    target.load_state_dict(other.state_dict())
    result = speculative_generate(target, PromptLookupDrafter(num_draft=6), prompt, GenerationConfig(max_new_tokens=30))
    assert result.new_tokens[0].tolist() == plain_greedy(other, prompt, 30)
