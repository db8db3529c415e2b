"""Batch > 1: every row of a batched speculative decode is that prompt's own output, token for
token in fp32 greedy and in distribution under sampling (at tree depth 2), whatever the other rows
accept, however long their prompts and whenever they finish."""

from collections import Counter

import pytest
import torch

from drafthead.inference.drafters.settings import TreeSettings
from drafthead.heads.registry import build_head, make_config
from drafthead.inference.engine.cache import cache_capacity, cache_kwargs, keep_paths, new_cache
from drafthead.inference.drafters.draft_model import DraftModelDrafter
from drafthead.inference.drafters.head_drafters import EagleDrafter
from drafthead.inference.drafters.prompt_lookup import PromptLookupDrafter
from drafthead.inference.engine.generate import GenerationConfig, speculative_generate
from drafthead.inference.engine.sampling import SamplingConfig
from drafthead.inference.engine.tree import DraftTree, pad_trees
from drafthead.inference.engine.verify import forward_trees
from tests.stats import chi_square_pvalue
from tests.law import ALPHA, VOCAB, exact_first_three
from tests.tiny import FAMILIES, TARGETS, left_padded, plain_greedy, prompts_of, tiny_causal_lm
from tests.head_checks import batch_drafters

LENGTHS = (1, 6, 13, 21)  # a one-token prompt has nothing to prefill: its drafter starts blind


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_batched_greedy_rows_equal_their_own_plain_greedy(family):
    target = tiny_causal_lm(family, layers=4)
    prompts = prompts_of(LENGTHS, seed=len(family))
    refs = [plain_greedy(target, p[None], 28) for p in prompts]
    ids, mask = left_padded(prompts)
    for name, drafter in batch_drafters(target, family).items():
        result = speculative_generate(target, drafter, ids, GenerationConfig(max_new_tokens=28), attention_mask=mask)
        assert [row.new_tokens[0].tolist() for row in result.rows] == refs, (family, name)
        assert all(row.finish_reason == "length" for row in result.rows)
        # one forward per round of the slowest row: the batch did not decode row by row
        assert result.num_forwards == max(row.num_rounds for row in result.rows), name


def test_rows_finish_independently_as_they_would_alone():
    """An EOS in one row's output and a context limit in another's: each row stops where its own
    batch-1 run stops, and the rows still running are unchanged by those leaving."""
    target = tiny_causal_lm("qwen2", layers=4)
    prompts = prompts_of((5, 9, 16, 30), seed=4)
    free = [plain_greedy(target, p[None], 40) for p in prompts]
    eos = free[1][6]  # row 1 emits this token early; the other rows may too, later or never
    config = GenerationConfig(max_new_tokens=40, eos_token_ids=(eos,), max_length=62)
    ids, mask = left_padded(prompts)
    batched = speculative_generate(target, PromptLookupDrafter(length=5), ids, config, attention_mask=mask)
    alone = [speculative_generate(target, PromptLookupDrafter(length=5), p[None], config) for p in prompts]
    assert [r.finish_reason for r in batched.rows] == [r.finish_reason for r in alone]
    assert [r.new_tokens.tolist() for r in batched.rows] == [r.new_tokens.tolist() for r in alone]
    reasons = {r.finish_reason for r in alone}
    assert "eos" in reasons and "context" in reasons, reasons  # both ways of leaving early were exercised
    assert batched.rows[1].new_tokens.shape[1] == free[1].index(eos) + 1  # stopped right after its EOS


@pytest.mark.parametrize("static", [False, True], ids=["dynamic-cache", "static-cache"])
@pytest.mark.parametrize("family", TARGETS)
def test_ragged_cache_matches_recomputation(family, static):
    """Rows of different lengths verify different trees in one forward: every node's logits equal
    a plain forward over that row's tokens and the node's path; after keep_paths moves each row's
    accepted path behind its own prefix, the next round's logits are right again. The same in a
    static cache, whose masks span all its slots and whose tensors never change shape. For the
    M-RoPE targets (Qwen2.5-VL, Qwen3-VL) this is the check on tree positions: their tiny models'
    greedy outputs barely depend on positions, logits do."""
    target = tiny_causal_lm(family, layers=2)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 96, (n,), generator=g) for n in (3, 11, 7)]  # committed tokens per row
    shapes = [[-1, 0, 0, 1, 2, 3], [-1, 0, 1], [-1, 0, 1, 1, 0, 4, 5, 2]]
    paths = [[0, 1, 3], [0], [0, 4, 5, 6]]
    capacity = 48 if static else None
    cache = new_cache(target.config.get_text_config().num_hidden_layers, capacity)
    slots = max(s.numel() for s in seqs)
    padded = torch.zeros(len(seqs), slots, dtype=torch.long)
    for b, s in enumerate(seqs):
        padded[b, : s.numel()] = s
    with torch.no_grad():
        target(input_ids=padded, **cache_kwargs(target, cache), use_cache=True)
        for round_ in range(2):
            trees = [DraftTree(torch.randint(3, 96, (1, len(p)), generator=g), torch.tensor(p)) for p in shapes]
            lengths = torch.tensor([s.numel() for s in seqs])
            out = forward_trees(target, cache, pad_trees(trees), lengths, slots, want_hidden=False)
            for b, (tree, seq) in enumerate(zip(trees, seqs)):
                parents = tree.parents.tolist()
                for node in range(tree.num_nodes):
                    path, i = [], node
                    while i >= 0:
                        path.append(int(tree.tokens[0, i]))
                        i = parents[i]
                    ref = target(torch.cat([seq, torch.tensor(path[::-1])])[None]).logits[0, -1]
                    torch.testing.assert_close(out.logits[b, node], ref, atol=2e-5, rtol=1e-4, msg=f"{round_} {b} {node}")
            slots = keep_paths(cache, lengths.tolist(), slots, paths)
            seqs = [torch.cat([seq, tree.tokens[0, path]]) for seq, tree, path in zip(seqs, trees, paths)]
            assert int(cache.get_seq_length()) == slots == max(s.numel() for s in seqs)
            if static:
                assert cache_capacity(cache) == cache.layers[0].keys.shape[2] == capacity  # never reshaped


COPIES = 64  # of each prompt in one batch: 128 rows, so each call draws many samples for its Python cost
BATCH_RUNS = 40  # x COPIES: 2560 samples per prompt (fewer pool every cell)


# (drafter, sampling): a sampled draft-model chain of 2, and an EAGLE head tree of depth 2 with a
# repetition penalty (sharp logits and a strong penalty, so that the law without it is far off)
SAMPLED_BATCH_CASES = {
    "draft-model-chain": (SamplingConfig(temperature=0.9), 0.25),
    "eagle3-tree-penalty": (SamplingConfig(temperature=1.0, repetition_penalty=3.0), 1.0),
}


@pytest.mark.parametrize("case", sorted(SAMPLED_BATCH_CASES))
def test_batched_sampling_is_exact_per_row_at_depth_two(case):
    """128 rows (two prompts of different lengths, COPIES times each) per batch: the first three
    tokens of each row follow that prompt's own law, and depth-2 paths were accepted whole."""
    sampling, lm_scale = SAMPLED_BATCH_CASES[case]
    target = tiny_causal_lm("llama", vocab=VOCAB, hidden=32, seed=3, layers=4)
    with torch.no_grad():
        target.lm_head.weight.mul_(lm_scale)
    if case == "draft-model-chain":
        draft = tiny_causal_lm("llama", vocab=VOCAB, hidden=32, seed=4)
        drafter = DraftModelDrafter(draft, num_draft=2, sampling=sampling, seed=0)
    else:
        head = build_head(make_config("eagle3", target, None, name="tiny", aux_layers=(1, 2, 3)), target).eval()
        drafter = EagleDrafter(head, TreeSettings(num_draft=6, depth=2, branch=2))
    prompts = [torch.tensor([3, 4, 5, 3, 4]), torch.tensor([6, 3])]
    ids, mask = left_padded(prompts * COPIES, pad=0)
    counts, deep = [Counter(), Counter()], 0
    for run in range(BATCH_RUNS):
        out = speculative_generate(target, drafter, ids, GenerationConfig(max_new_tokens=3, sampling=sampling, seed=run), attention_mask=mask)
        for b, row in enumerate(out.rows):
            counts[b % 2][tuple(row.new_tokens[0].tolist())] += 1
            deep += row.accepted_lengths[0] == 3
    assert deep > 0  # some rows accepted a depth-2 path in their first round
    for prompt, count in zip(prompts, counts):
        exact = exact_first_three(target, prompt[None], sampling)
        assert chi_square_pvalue(count, exact, COPIES * BATCH_RUNS) > ALPHA, prompt.tolist()


def test_batched_greedy_with_mixed_sliding_and_full_layers():
    """Gemma-3's layer mix (sliding-window and full attention layers, one mask each): rows of
    different lengths past the window still equal their own plain greedy output."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        sliding_window=5,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        max_position_embeddings=256,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    target = Gemma3ForCausalLM(config).eval().requires_grad_(False)
    with torch.no_grad():
        target.lm_head.weight.mul_(4.0)  # tied to the embeddings: sharper logits, fewer near-ties
    prompts = prompts_of((2, 7, 12), seed=9)
    refs = [plain_greedy(target, p[None], 20) for p in prompts]
    ids, mask = left_padded(prompts)
    for drafter in (PromptLookupDrafter(length=5), DraftModelDrafter(target, num_draft=3)):
        result = speculative_generate(target, drafter, ids, GenerationConfig(max_new_tokens=20), attention_mask=mask)
        assert [row.new_tokens[0].tolist() for row in result.rows] == refs, type(drafter).__name__
