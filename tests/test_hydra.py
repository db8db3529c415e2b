"""Hydra heads (heads/hydra.py, HydraDrafter): the loss equals a position-by-position twin, a
fresh Hydra head is a fresh Medusa head, each drafted node reads its own path, and decoding is
exact (greedy at batch 1 and 3, sampling at depth 2)."""

import pytest
import torch
import torch.nn.functional as F

from drafthead.inference.drafters.settings import StaticTreeSettings
from drafthead.heads.registry import build_head, make_config
from drafthead.inference.drafters.head_drafters import HydraDrafter, MedusaDrafter
from drafthead.inference.engine.generate import GenerationConfig, speculative_generate
from drafthead.inference.engine.sampling import SamplingConfig
from tests.tiny import left_padded, prompts_of
from tests.head_checks import target_feature_batch
from tests.law import VOCAB, assert_law_at_depth_two
from tests.tiny import FAMILIES, plain_greedy, repetitive_prompt, tiny_causal_lm

CHOICES = [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]


def hydra(target, seed=0, **extra):
    head = build_head(make_config("hydra", target, None, name="tiny", num_heads=3, **extra), target)
    torch.manual_seed(seed)
    with torch.no_grad():  # away from the identity init, so that every input matters
        for p in head.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return head


def test_loss_equals_the_position_by_position_twin():
    target = tiny_causal_lm("llama", layers=3)
    head = hydra(target)
    batch = target_feature_batch(target, B=2, T=12)
    loss, metrics = head.compute_loss(batch)
    ids, h = batch.input_ids, batch.hidden_states[head.config.final_layer]
    embed = target.get_input_embeddings()
    want = 0.0
    for k in range(head.num_heads):
        ces = []
        for b in range(ids.shape[0]):
            for t in range(ids.shape[1] - k - 2):
                if not batch.loss_mask[b, t + k + 2]:
                    continue
                x = torch.cat([h[b, t]] + [embed(ids[b, t + j]) for j in range(1, k + 2)])  # [(k + 2) H]
                logits = head.lm_heads[k](head.blocks[k](head.inputs[k](x)))
                ces.append(F.cross_entropy(logits[None], ids[b, t + k + 2][None]))
        want = want + head.config.loss_decay**k * torch.stack(ces).mean()
    assert torch.allclose(loss, want, atol=1e-5), (loss.item(), want.item())
    assert metrics["num_labels"] > 0


def test_a_fresh_hydra_head_drafts_what_a_fresh_medusa_head_drafts():
    target = tiny_causal_lm("qwen2", layers=3)
    fresh = build_head(make_config("hydra", target, None, name="tiny", num_heads=3), target).eval()
    medusa = build_head(make_config("medusa1", target, None, name="tiny", num_heads=3), target).eval()
    medusa.load_state_dict({k: v for k, v in fresh.state_dict().items() if not k.startswith("inputs.")})
    prompt = repetitive_prompt(96, seed=3)
    a = speculative_generate(target, HydraDrafter(fresh, StaticTreeSettings(choices=CHOICES)), prompt, GenerationConfig(max_new_tokens=20))
    b = speculative_generate(target, MedusaDrafter(medusa, StaticTreeSettings(choices=CHOICES)), prompt, GenerationConfig(max_new_tokens=20))
    assert a.accepted_lengths == b.accepted_lengths and a.drafted == b.drafted


def test_each_node_is_drafted_from_its_own_path():
    target = tiny_causal_lm("llama", layers=3)
    head = hydra(target).eval()
    drafter = HydraDrafter(head, StaticTreeSettings(choices=CHOICES))
    prompt = repetitive_prompt(96, seed=1)
    with torch.no_grad():
        hs = target(prompt[:, :-1], output_hidden_states=True).hidden_states
    from drafthead.inference.engine.drafter import TargetFeatures

    drafter.begin(prompt[:, :-1], TargetFeatures((head.config.final_layer,), (hs[-1],), hs[-1]), prompt[0, -1:])
    tree = drafter.propose()
    parents, tokens = tree.parents.tolist(), tree.tokens[0].tolist()
    embed = target.get_input_embeddings()
    for node, rank in zip(range(1, len(tokens)), drafter.shape.rank[1:].tolist()):
        path = [node]
        while parents[path[0]] > 0:
            path.insert(0, parents[path[0]])
        path_tokens = [tokens[0]] + [tokens[n] for n in path[:-1]]  # pending token, then the drafts above
        k = len(path) - 1
        with torch.no_grad():
            x = torch.cat([hs[-1][0, -1]] + [embed(torch.tensor(t)) for t in path_tokens])
            logits = head.lm_heads[k](head.blocks[k](head.inputs[k](x)))
        assert tokens[node] == int(torch.topk(logits, rank + 1).indices[rank]), node


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_greedy_with_hydra_heads_equals_plain_greedy(family):
    target = tiny_causal_lm(family, layers=4)
    head = hydra(target).eval()
    prompt = repetitive_prompt(96, seed=6)
    result = speculative_generate(target, HydraDrafter(head, StaticTreeSettings(num_draft=8)), prompt, GenerationConfig(max_new_tokens=30))
    assert result.new_tokens[0].tolist() == plain_greedy(target, prompt, 30), family
    prompts = prompts_of((1, 7, 15), seed=4)
    ids, mask = left_padded(prompts)
    batched = speculative_generate(
        target, HydraDrafter(head, StaticTreeSettings(choices=CHOICES)), ids, GenerationConfig(max_new_tokens=20), attention_mask=mask
    )
    assert [row.new_tokens[0].tolist() for row in batched.rows] == [plain_greedy(target, p[None], 20) for p in prompts]


def test_hydra_tree_sampling_is_exact_at_depth_two():
    sampling = SamplingConfig(temperature=0.9)
    target = tiny_causal_lm("llama", vocab=VOCAB, hidden=32, seed=3, layers=4)
    head = hydra(target, seed=1).eval()
    prompt = torch.tensor([[3, 4, 5, 3, 4]])
    drafter = HydraDrafter(head, StaticTreeSettings(choices=[(0,), (1,), (0, 0), (1, 0)]))
    assert_law_at_depth_two(target, drafter, prompt, sampling)
