"""Captured steps (inference/engine/graphs.py, docs/trees.md "Captured steps"): the round forward at
padded node counts, the graphed EAGLE chain and the batched greedy loop, each equal to plain
greedy decoding in float32. On the CPU the steps run eagerly on their static buffers (the code a
GPU replays, its padding included), and through dynamo with fullgraph=True ("traced"): a step
that read a value back to the host or branched on one would break the trace, and one whose
rounds retraced it would add graphs; neither could be recorded as a CUDA graph. The recording
itself runs in scripts/gpu/run.py on a GPU."""

import pytest
import torch
from torch._dynamo.utils import counters

from drafthead.heads.registry import build_head, make_config
from drafthead.inference.drafters import chain_graph
from drafthead.inference.drafters.chain_graph import GraphedChainDrafter
from drafthead.inference.drafters.head_drafters import EagleDrafter
from drafthead.inference.drafters.load import chain_settings
from drafthead.inference.engine.compiled import TREE_ROOM, StaticDecoding
from drafthead.inference.engine.drafter import DrafterBase, RootOnlyDrafter, fork_drafter
from drafthead.inference.engine.generate import GenerationConfig, speculative_generate
from drafthead.inference.engine.graphs import NODE_BUCKETS, node_bucket
from drafthead.inference.engine.greedy_graph import GreedyDecoder, greedy_batch
from drafthead.inference.engine.tree import DraftTree
from drafthead.inference.drafters.load import head_drafter
from tests.oracle import OracleDrafter, accepted_drafts, assert_accepts_and_stays_exact, by_row, known_continuation
from tests.tiny import left_padded, plain_greedy, prompts_of, repetitive_prompt, tiny_causal_lm

NEW = 24


def peaked(target):
    """`target` with queries and keys scaled up 8x: a tiny random target attends almost uniformly,
    so a wrong position or mask would hardly move its argmax; this one's would."""
    with torch.no_grad():
        for layer in target.model.layers:
            layer.self_attn.q_proj.weight.mul_(8.0)
            layer.self_attn.k_proj.weight.mul_(8.0)
    return target


def target_and_head():
    target = peaked(tiny_causal_lm("llama", layers=4))
    config = make_config("eagle3", target, None, name="tiny", draft_vocab_size=64, aux_layers=(1, 2, 3))
    return target, build_head(config, target, token_counts=torch.arange(96), dtype=torch.float32).eval()


def graphs_added(run) -> int:
    """Graphs dynamo traced while `run()` ran (its counters are the process's)."""
    before = counters["stats"]["unique_graphs"]
    run()
    return counters["stats"]["unique_graphs"] - before


@pytest.mark.parametrize("mode", ["graphs", "graphs-traced"])
def test_round_forwards_at_padded_node_counts_equal_plain_greedy(mode):
    """EAGLE-2 trees of 25 nodes (padded to 32) steered to accept deep paths, at batch 1 and in a
    ragged batch of 3, and plain rounds (1 node): the output is plain greedy decoding's, and
    every round after the first ran one of the forward's steps."""
    target, head = target_and_head()
    prompt = repetitive_prompt(96, seed=8)
    prompts = prompts_of((5, 9, 13), seed=2)
    ids, mask = left_padded(prompts)

    def config(new):
        return GenerationConfig(max_new_tokens=new, compile=mode)

    def run():
        assert_accepts_and_stays_exact(
            target,
            lambda: head_drafter(head),
            prompt,
            plain_greedy(target, prompt, NEW),
            prompts,
            [plain_greedy(target, p[None], NEW) for p in prompts],
            ids,
            mask,
            NEW,
            NEW,
            config,
        )

    traced = graphs_added(run)
    forward = StaticDecoding.of(target, mode).forward
    steps = sum(len(s) for s in forward._steps.values())
    assert steps >= 2 and forward.eager_calls == 0
    if mode == "graphs-traced":
        assert 1 <= traced <= steps  # one trace per step at most, however many rounds ran it
    plain = speculative_generate(target, RootOnlyDrafter(), prompt, config(NEW))
    assert plain.new_tokens[0].tolist() == plain_greedy(target, prompt, NEW)


def test_the_largest_bucket_fits_a_rounds_room_and_larger_trees_run_unrecorded():
    assert NODE_BUCKETS[-1] <= TREE_ROOM  # padding never writes past the static cache
    assert [node_bucket(n) for n in (1, 3, 25, 128, 129)] == [1, 4, 32, 128, None]

    class Wide(DrafterBase):  # 199 children of the root, every id in turn
        def propose(self) -> DraftTree:
            root = self.history[:, -1:]
            return DraftTree(torch.cat([root, (torch.arange(199) % 96)[None]], dim=1), torch.tensor([-1] + [0] * 199))

    target = tiny_causal_lm("qwen2", layers=2)
    prompt = prompts_of((9,), seed=4)[0][None]
    result = speculative_generate(target, Wide(), prompt, GenerationConfig(max_new_tokens=12, compile="graphs"))
    assert result.new_tokens[0].tolist() == plain_greedy(target, prompt, 12)
    assert StaticDecoding.of(target, "graphs").forward.eager_calls > 0 and max(result.drafted) > 128


class Twin:
    """Drafts with the graphed chain and checks, every round, that EagleDrafter's chain of the same
    head drafts the same tree; both see the same commits."""

    def __init__(self, graphed, eagle):
        self.graphed, self.eagle = graphed, eagle
        self.feature_layers, self.needs_last_hidden = graphed.feature_layers, False
        self.rounds = 0

    def fork(self):
        return Twin(fork_drafter(self.graphed), fork_drafter(self.eagle))

    def begin(self, tokens, features, pending):
        self.graphed.begin(tokens, features, pending)
        self.eagle.begin(tokens, features, pending)

    def commit(self, tokens, features, pending, stats):
        self.graphed.commit(tokens, features, pending, stats)
        self.eagle.commit(tokens, features, pending, stats)

    def propose(self) -> DraftTree:
        tree, expected = self.graphed.propose(), self.eagle.propose()
        assert tree.tokens.tolist() == expected.tokens.tolist() and tree.parents.tolist() == expected.parents.tolist()
        self.rounds += 1
        return tree


@pytest.mark.parametrize("mode", ["eager", "traced"])
@pytest.mark.parametrize("room", [None, 16])
def test_the_graphed_chain_drafts_the_eagle_chain_and_stays_exact(mode, room, monkeypatch):
    """Steered to accept up to its whole chain (so a round catches up on 1 to k + 1 pairs), at
    batch 1 and in a ragged batch of 3: every round's chain is EagleDrafter's chain of 3, and the
    output is plain greedy decoding's. room 16: the head cache starts small and grows over the
    generation (its committed pairs copied into a larger one)."""
    if room is not None:
        monkeypatch.setattr(chain_graph, "CAPACITY_STEP", room)
    target, head = target_and_head()
    prompt = repetitive_prompt(96, seed=8)
    prompts = prompts_of((5, 9, 13), seed=2)
    ids, mask = left_padded(prompts)
    references = [plain_greedy(target, p[None], NEW) for p in [prompt[0], *prompts]]
    continuation = known_continuation([p.tolist() + r for p, r in zip([prompt[0], *prompts], references)])

    def twin():
        return Twin(GraphedChainDrafter(head, 3, mode=mode), EagleDrafter(head, chain_settings("eagle3", 3)))

    config = GenerationConfig(max_new_tokens=NEW, compile="graphs")
    drafter = twin()
    one = speculative_generate(target, OracleDrafter(drafter, continuation, 96, lambda s, r: None if r % 3 else 2), prompt, config)
    assert one.new_tokens[0].tolist() == references[0]
    assert {1, 3} <= set(accepted_drafts(one)) and drafter.rounds == len(one.accepted_lengths)
    batched = speculative_generate(target, OracleDrafter(twin(), continuation, 96, by_row), ids, config, attention_mask=mask)
    assert [row.new_tokens[0].tolist() for row in batched.rows] == references[1:]
    assert [max(accepted_drafts(row)) for row in batched.rows] == [3, 1, 0]
    assert drafter.graphed.replays == 0  # no GPU: the steps ran without recording


def test_the_graphed_chain_traces_once_for_all_rounds():
    target, head = target_and_head()
    prompt = repetitive_prompt(96, seed=3)
    drafters = [GraphedChainDrafter(head, 3, mode="traced") for _ in range(2)]
    config = GenerationConfig(max_new_tokens=NEW, compile="graphs")
    added = graphs_added(lambda: [speculative_generate(target, d, prompt, config) for d in drafters])
    assert added <= 1  # one trace of the step, or none where an earlier test traced it


def test_a_chain_needs_a_head_that_drafts_step_by_step():
    target = tiny_causal_lm("llama", layers=2)
    medusa = build_head(make_config("medusa1", target, None, name="tiny"), target, dtype=torch.float32)
    with pytest.raises(ValueError, match="does not draft step by step"):
        GraphedChainDrafter(medusa, 3)
    with pytest.raises(ValueError, match="k >= 1"):
        GraphedChainDrafter(target_and_head()[1], 0)


@pytest.mark.parametrize("mode", ["eager", "traced"])
def test_the_greedy_loop_equals_each_rows_plain_greedy(mode):
    """Ragged rows (a one-token prompt among them), two batches of other prompt lengths through
    one decoder (one step for both), a batch smaller than the decoder's rows, and stop tokens:
    each row is its own plain greedy continuation, cut after its first stop token."""
    target = peaked(tiny_causal_lm("llama", layers=4))
    first, second = prompts_of((1, 6, 13, 21), seed=5), prompts_of((4, 17, 9), seed=6)
    decoder = GreedyDecoder(target, rows=4, slots=21 + 20, mode=mode)
    assert decoder.run(first, 20) == [plain_greedy(target, p[None], 20) for p in first]
    step = decoder.step
    assert step is not None
    references = [plain_greedy(target, p[None], 20) for p in second]
    stop = references[1][4]
    expected = [r[: r.index(stop) + 1] if stop in r else r for r in references]
    added = graphs_added(lambda: decoder.run(second, 20, stop_ids=[stop]))
    assert decoder.run(second, 20, stop_ids=[stop]) == expected and len(expected[1]) == 5
    assert decoder.step is step and added == 0  # recorded (traced) once, by the first batch
    assert greedy_batch(target, second, 12, mode=mode) == [r[:12] for r in references]


def test_the_greedy_loop_refuses_what_does_not_fit():
    target = tiny_causal_lm("llama", layers=2)
    decoder = GreedyDecoder(target, rows=2, slots=16)
    prompts = prompts_of((6, 9), seed=1)
    with pytest.raises(ValueError, match="more than the decoder's 16 slots"):
        decoder.run(prompts, 8)
    with pytest.raises(ValueError, match="1 to 2 prompts"):
        decoder.run(prompts * 2, 4)
