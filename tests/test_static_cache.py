"""The static KV cache and the compiled round forward (inference/engine/compiled.py, docs/trees.md
"Static cache"): the same tokens as plain greedy decoding, at batch 1 and with ragged rows, and
a compiled graph reused across rounds and generations instead of recompiled. (The cache's
per-node logits over rounds: tests/test_batch.py::test_ragged_cache_matches_recomputation.)"""

import pytest
import torch
from torch._dynamo.utils import counters

from drafthead.inference.engine.compiled import CAPACITY_STEP, TREE_ROOM, StaticDecoding, static_capacity
from drafthead.inference.engine.drafter import DrafterBase
from drafthead.inference.drafters.prompt_lookup import PromptLookupDrafter
from drafthead.inference.kernels import target_linears
from drafthead.inference.engine.generate import GenerationConfig, speculative_generate
from drafthead.inference.kernels.target_linears import ROW_BUCKETS
from drafthead.inference.engine.tree import DraftTree
from tests.head_checks import batch_drafters
from tests.tiny import left_padded, prompts_of
from tests.tiny import FAMILIES, plain_greedy, tiny_causal_lm


def test_capacity_rounds_up_past_a_round_of_room():
    assert static_capacity(10, 20) == CAPACITY_STEP
    assert static_capacity(CAPACITY_STEP, 1) == 2 * CAPACITY_STEP  # prompt + new tokens + TREE_ROOM
    assert static_capacity(CAPACITY_STEP - TREE_ROOM - 5, 5) == CAPACITY_STEP


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_static_cache_rows_equal_their_own_plain_greedy(family):
    """Every drafter kind, batch 1 and four ragged left-padded rows: fp32 greedy through the
    static cache is each prompt's own plain greedy output."""
    target = tiny_causal_lm(family, layers=4)
    prompts = prompts_of((1, 6, 13, 21), seed=len(family))
    refs = [plain_greedy(target, p[None], 28) for p in prompts]
    ids, mask = left_padded(prompts)
    config = GenerationConfig(max_new_tokens=28, static_cache=True)
    for name, drafter in batch_drafters(target, family).items():
        batched = speculative_generate(target, drafter, ids, config, attention_mask=mask)
        assert [row.new_tokens[0].tolist() for row in batched.rows] == refs, (family, name)
        alone = speculative_generate(target, drafter, prompts[2][None], config)
        assert alone.new_tokens[0].tolist() == refs[2], (family, name)


class StarDrafter(DrafterBase):
    """Drafts `width` children of the root, every vocabulary id in turn: a tree wider than any room."""

    def __init__(self, width: int, vocab: int):
        super().__init__()
        self.width, self.vocab = width, vocab

    def propose(self) -> DraftTree:
        root = self.history[:, -1:]
        children = (torch.arange(self.width) % self.vocab)[None]
        return DraftTree(torch.cat([root, children], dim=1), torch.tensor([-1] + [0] * self.width))


def test_a_tree_larger_than_the_room_left_keeps_its_first_nodes():
    """A static cache leaves TREE_ROOM slots (at the least) for a round's tree: a wider tree is cut
    to its first nodes (still a tree), and the output is unchanged."""
    target = tiny_causal_lm("qwen2", layers=2)
    prompt = prompts_of((9,), seed=2)[0][None]
    capacity = static_capacity(prompt.shape[1], 12)
    drafter = StarDrafter(width=capacity, vocab=target.config.vocab_size)
    result = speculative_generate(target, drafter, prompt, GenerationConfig(max_new_tokens=12, static_cache=True))
    assert result.new_tokens[0].tolist() == plain_greedy(target, prompt, 12)
    # cut to the slots left: capacity - (committed + the root), never below TREE_ROOM
    assert all(TREE_ROOM <= n <= capacity - prompt.shape[1] < drafter.width for n in result.drafted), result.drafted
    assert result.tau > 1  # the star holds every token: the kept part still accepts


@pytest.mark.parametrize("kernel", ["plain", "packed", "panel"])
def test_compiled_rounds_equal_plain_greedy_and_reuse_their_graphs(kernel, monkeypatch):
    """The round forward through torch.compile (the aot_eager backend: dynamo's capture, guards
    and functionalised cache writes, without inductor's slow C++ build, which `bench --compile`
    checks on the real target), with the target's linears plain or all dispatched to packed or
    panel kernels (a custom op in the graph): greedy output equals plain greedy, and a second
    prompt of another length reuses the graphs the first one compiled."""
    if kernel != "plain":
        monkeypatch.setattr(target_linears, "calibrate", lambda layers: (kernel,) * len(ROW_BUCKETS))
    target = tiny_causal_lm("llama", layers=2)
    prompts = prompts_of((6, 21), seed=3)
    config = GenerationConfig(max_new_tokens=24, compile="aot_eager")
    first = speculative_generate(target, PromptLookupDrafter(length=5), prompts[0][None], config)
    assert first.new_tokens[0].tolist() == plain_greedy(target, prompts[0][None], 24)
    graphs = counters["stats"]["unique_graphs"]
    assert graphs >= 1
    second = speculative_generate(target, PromptLookupDrafter(length=5), prompts[1][None], config)
    assert second.new_tokens[0].tolist() == plain_greedy(target, prompts[1][None], 24)
    assert counters["stats"]["unique_graphs"] == graphs  # no recompilation
    assert StaticDecoding.of(target, "aot_eager").compiled
