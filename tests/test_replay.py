"""Replayed greedy rounds (inference/bench/replay.py) against the engine's own: the same accepted
lengths, round for round, for trained heads of three drafter families and for prompt lookup."""

import pytest
import torch

from drafthead.heads.registry import build_head, make_config
from drafthead.inference.engine.drafter import DrafterBase, RootOnlyDrafter
from drafthead.inference.drafters.parallel import DFlashDrafter
from drafthead.inference.drafters.prompt_lookup import PromptLookupDrafter
from drafthead.inference.engine.generate import GenerationConfig, speculative_generate
from drafthead.inference.bench.replay import DRAFTHEAD, VLLM, replay_greedy, sequence_hidden_states, tokens_past_end
from drafthead.inference.engine.tree import DraftTree
from tests.head_checks import KINDS, make_drafter, self_generated_batch, train_head
from tests.tiny import repetitive_prompt, tiny_causal_lm

NEW_TOKENS = 30


def engine_and_replay(target, new_drafter, prompt):
    result = speculative_generate(target, new_drafter(), prompt, GenerationConfig(max_new_tokens=NEW_TOKENS))
    sequence = torch.cat([prompt, result.new_tokens], dim=1)
    drafter = new_drafter()
    replayed = replay_greedy(drafter, sequence, prompt.shape[1], sequence_hidden_states(target, sequence, [drafter]))
    return result.accepted_lengths, replayed


def trained_drafter_factory(kind: str, target):
    if kind == "dflash":  # mask token 95: the tiny models' pad token 2 has a zero embedding row
        head = build_head(make_config(kind, target, None, name="tiny", block_size=4, mask_token_id=95), target)
        head = train_head(head, self_generated_batch(target))
        return lambda: DFlashDrafter(head)
    head = build_head(make_config(kind, target, None, name="tiny", **KINDS[kind]), target, token_counts=torch.ones(96, dtype=torch.long))
    head = train_head(head, self_generated_batch(target))
    return lambda: make_drafter(head)


@pytest.mark.parametrize("kind", ["eagle3", "peagle", "medusa1", "dflash"])
def test_replay_matches_the_engine_round_for_round_with_trained_heads(kind):
    target = tiny_causal_lm("llama", layers=4)
    new_drafter = trained_drafter_factory(kind, target)
    seen = []
    for seed in (100, 101, 7):  # two prompts the head memorised, one it did not
        engine, replayed = engine_and_replay(target, new_drafter, repetitive_prompt(96, seed=seed)[:, :8])
        assert replayed == engine, (kind, seed)
        assert sum(replayed) == NEW_TOKENS
        seen += replayed
    assert max(seen) > 1  # the comparison saw accepted drafts, not only plain rounds


def test_replay_matches_the_engine_with_prompt_lookup():
    target = tiny_causal_lm("qwen2", layers=2)
    engine, replayed = engine_and_replay(target, lambda: PromptLookupDrafter(length=6), repetitive_prompt(96, 24, seed=3))
    assert replayed == engine
    assert max(replayed) > 1


class ChainOf(DrafterBase):
    """Drafts `k` tokens of `truth` after its history, each shifted by `offset` (0: always right)."""

    def __init__(self, truth: torch.Tensor, k: int, offset: int = 0):
        super().__init__()
        self.truth, self.k, self.offset = truth, k, offset

    def propose(self) -> DraftTree:
        n = self.history.shape[1]
        chain = (self.truth[0, n : n + self.k] + self.offset) % 96
        tokens = torch.cat([self.history[0, -1:], chain])[None]
        return DraftTree(tokens, torch.arange(-1, chain.numel()))


def test_replay_of_always_right_and_always_wrong_chains():
    sequence = torch.randint(3, 96, (1, 8 + 23), generator=torch.Generator().manual_seed(0))
    # 23 new tokens: rounds of 3 drafts + the target's token, the last round what is left
    assert replay_greedy(ChainOf(sequence, 3), sequence, 8) == [4, 4, 4, 4, 4, 3]
    assert replay_greedy(ChainOf(sequence, 3, offset=1), sequence, 8) == [1] * 23


def test_counting_as_vllm_starts_after_the_prefill_token_and_counts_the_whole_last_chain():
    sequence = torch.randint(3, 96, (1, 8 + 23 + 3), generator=torch.Generator().manual_seed(0))
    end = 8 + 23  # 3 tokens past the answer's end: the target's next greedy ones
    # ours: the first round drafts the first token, the last round keeps what the answer keeps
    assert replay_greedy(ChainOf(sequence, 3), sequence, 8, end=end) == [4, 4, 4, 4, 4, 3]
    assert replay_greedy(ChainOf(sequence, 3), sequence, 8, end=end, counting=DRAFTHEAD) == [4, 4, 4, 4, 4, 3]
    # vLLM: 22 tokens after the prefill's; the last step accepts its whole chain past the end
    assert replay_greedy(ChainOf(sequence, 3), sequence, 8, end=end, counting=VLLM) == [4] * 6
    # with no tokens past the end known, drafts there count as rejected
    assert replay_greedy(ChainOf(sequence, 3), sequence[:, :end], 8, counting=VLLM) == [4] * 5 + [3]
    assert replay_greedy(ChainOf(sequence, 3, offset=1), sequence, 8, end=end, counting=VLLM) == [1] * 22
    assert replay_greedy(ChainOf(sequence, 3), sequence, 8, end=9, counting=VLLM) == []  # the prefill's token only


def test_tokens_past_end_are_the_targets_next_greedy_tokens_eos_or_not():
    target = tiny_causal_lm("llama", layers=2)
    prompt = repetitive_prompt(96, seed=4)[:, :6]
    plain = speculative_generate(target, RootOnlyDrafter(), prompt, GenerationConfig(max_new_tokens=9))
    tokens = plain.new_tokens[0].tolist()
    answer = torch.cat([prompt, plain.new_tokens[:, :5]], dim=1)  # as if tokens[4] were an EOS
    assert tokens_past_end(target, [answer, prompt], 4, engine_linears=False) == [tokens[5:9], tokens[:4]]


def test_replay_refuses_bad_input():
    target = tiny_causal_lm("llama", layers=2)
    head = build_head(
        make_config("eagle3", target, None, name="tiny", **KINDS["eagle3"]), target, token_counts=torch.ones(96, dtype=torch.long)
    ).eval()
    sequence = repetitive_prompt(96, seed=1)
    with pytest.raises(ValueError, match="reads target features"):
        replay_greedy(make_drafter(head), sequence, 4)
    with pytest.raises(ValueError, match=r"must be \[1, T\]"):
        replay_greedy(PromptLookupDrafter(length=4), sequence.repeat(2, 1), 4)
    with pytest.raises(ValueError, match="leave no answer"):
        replay_greedy(PromptLookupDrafter(length=4), sequence, sequence.shape[1])
    with pytest.raises(ValueError, match="leave no answer"):
        replay_greedy(PromptLookupDrafter(length=4), sequence, 4, end=sequence.shape[1] + 1)
