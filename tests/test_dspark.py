"""DSpark (heads/dspark.py, inference/drafters/parallel.py DSparkDrafter): the many-block loss
equals a slow block-by-block twin (under the decay and under D-PACE), the cached drafter equals
drafting from scratch, a tree node's candidates are its own parent's, decoding is exact (greedy at
batch 1 and ragged 3 on every family, sampling at depth 2), and the confidence head changes how
much is verified, never the output."""

import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from drafthead.inference.engine.sizing import set_verify_cost
from drafthead.inference.drafters.settings import StaticTreeSettings
from drafthead.heads.config import DSparkConfig
from drafthead.heads.formats import detect_layout, export_head, import_head
from drafthead.heads.io import HeadFormatError
from drafthead.heads.dflash import sample_anchors
from drafthead.heads.losses import dpace_weights
from drafthead.heads.registry import build_head, make_config
from drafthead.inference.drafters.parallel import DSparkDrafter
from drafthead.inference.engine.cost import CostCurve
from drafthead.inference.engine.drafter import TargetFeatures
from drafthead.inference.engine.generate import GenerationConfig, speculative_generate
from tests.head_checks import assert_drafts_match_recomputation, assert_greedy_equals_plain, slow_dpace_sum, target_feature_batch
from tests.law import VOCAB, assert_static_tree_sampling_exact
from tests.tiny import TARGETS, plain_greedy, repetitive_prompt, tiny_causal_lm

MASK = 95  # not 2, the tiny models' pad token: its embedding row is zero


def dspark(target, block=4, rank=8, **extra):
    config = make_config("dspark", target, None, name="tiny", block_size=block, mask_token_id=MASK, markov_rank=rank, **extra)
    head = build_head(config, target)
    with torch.no_grad():  # a Markov bias large enough to change the drafts (it starts near zero)
        head.markov_head.markov_w1.weight.normal_(0, 1.0, generator=torch.Generator().manual_seed(5))
        head.markov_head.markov_w2.weight.normal_(0, 1.0, generator=torch.Generator().manual_seed(6))
    return head


def slow_loss(head, batch, anchors, ok):
    """Block by block, as inference drafts: the fused features of positions 0..a-1 as context, one
    block after them; slot k's logits biased by the text's token a + k, scored against token
    a + k + 1 (CE), the target's distribution (L1) and the confidence label."""
    cfg = head.config
    ids = batch.input_ids
    B, T = ids.shape
    label_ok = batch.loss_mask.bool() & batch.attention_mask.bool()
    fused = head.fuse([batch.hidden_states[i] for i in cfg.feature_layers])
    lm = head.refs.lm_head.weight
    blocks = []  # per block: [(k, term, confidence)] of its scored slots
    for b in range(B):
        for j in range(anchors.shape[1]):
            if not ok[b, j]:
                continue
            a = int(anchors[b, j])
            context = head.context(fused[b : b + 1, :a], torch.arange(a)[None])
            h, base = head.block_states(ids[b, a : a + 1], a, context)
            scored = []
            for k in range(cfg.block_size):
                if a + k + 1 >= T or not label_ok[b, a + k + 1]:
                    continue
                prev = ids[b, a + k]
                log_q = torch.log_softmax(head.corrected_logits(base[0, k], prev), dim=-1)
                p = torch.softmax(batch.hidden_states[cfg.final_layer][b, a + k] @ lm.T, dim=-1)
                ce = -log_q[ids[b, a + k + 1]]
                l1 = (log_q.exp() - p).abs().sum()
                label = (1 - l1 / 2).clamp(0, 1)
                bce = F.binary_cross_entropy_with_logits(head.confidence_logit(h[0, k], prev), label)
                scored.append((k, cfg.ce_weight * ce + cfg.l1_weight * l1 + cfg.confidence_weight * bce, float(torch.exp(-ce))))
            blocks.append(scored)
    if cfg.loss == "dspark":
        num = sum(math.exp(-k / cfg.loss_decay_gamma) * term for scored in blocks for k, term, _ in scored)
        return num / sum(math.exp(-k / cfg.loss_decay_gamma) for scored in blocks for k, _, _ in scored)
    chains = [scored for scored in blocks if scored]  # D-PACE: each block's chain
    return sum(slow_dpace_sum(scored, cfg.block_size, cfg.dpace_alpha) for scored in chains) / len(chains)


@pytest.mark.parametrize("extra", [{}, {"num_layers": 2, "loss_decay_gamma": 2.0}, {"loss": "dpace", "dpace_alpha": 0.3}])
def test_loss_equals_the_block_by_block_twin(extra):
    target = tiny_causal_lm("llama", layers=3)
    head = dspark(target, block=4, num_anchors=5, **extra)
    batch = target_feature_batch(target, T=16)
    anchors, ok = sample_anchors(batch.labels_ok, head.config.num_anchors, generator=torch.Generator().manual_seed(1))
    loss, metrics = head.block_loss(batch, anchors, ok)
    with torch.no_grad():
        want = slow_loss(head, batch, anchors, ok)
    assert torch.allclose(loss, want, atol=1e-5), (loss.item(), float(want))
    assert metrics["num_labels"] > 0 and {"acc_3", "alpha_3", "conf_3", "l1_0"} <= set(metrics)
    loss.backward()
    for p in (head.fc.weight, head.markov_head.markov_w1.weight, head.markov_head.markov_w2.weight, head.confidence_head.proj.weight):
        assert p.grad is not None and p.grad.abs().sum() > 0
    assert head.refs.lm_head.weight.grad is None  # the target's LM head stays frozen


def test_dpace_weights_are_suffix_sums_of_smoothed_prefix_products():
    q = torch.tensor([[0.5, 0.2, 0.9], [1.0, 0.0, 0.4]])
    valid = torch.tensor([[True, True, True], [True, False, True]])
    w = dpace_weights(q, valid, 0.5)
    s = [[0.75, 0.6, 0.95], [1.0, 1.0, 0.7]]  # row 1's invalid middle position passes the product as 1
    p0 = [0.75, 0.75 * 0.6, 0.75 * 0.6 * 0.95]
    p1 = [1.0, 1.0, 0.7]
    want = [[sum(p0[m:]) for m in range(3)], [p1[0] + p1[2], 0.0, p1[2]]]
    assert torch.allclose(w, torch.tensor(want)), (w, want, s)
    assert torch.allclose(dpace_weights(q, valid, 1.0), torch.tensor([[3.0, 2.0, 1.0], [2.0, 0.0, 1.0]]))  # a = 1: linear


def test_config_checks():
    target = tiny_causal_lm("llama", layers=4)
    with pytest.raises(ValueError, match="DSpark needs mask_token_id"):
        make_config("dspark", target, None, name="tiny")
    with pytest.raises(ValueError, match="dspark, dpace"):
        make_config("dspark", target, None, name="tiny", mask_token_id=MASK, loss="ce")
    with pytest.raises(ValueError, match="confidence_head"):
        make_config("dspark", target, None, name="tiny", mask_token_id=MASK, confidence_head=False)
    with pytest.raises(ValueError, match="a chain of draft positions"):
        make_config("eagle1", target, None, name="tiny", loss="dpace", ce_to_target_dist=True)
    config = make_config("dspark", target, None, name="tiny", mask_token_id=MASK)
    assert config.num_drafted == config.block_size == 7 and config.markov_rank == 256
    assert DSparkConfig.from_dict(config.to_dict()) == config


def test_cached_drafting_equals_drafting_from_scratch_across_rounds():
    target = tiny_causal_lm("qwen2", layers=4)
    head = dspark(target, block=4).eval()
    drafter = DSparkDrafter(head)  # the greedy chain of 4 tokens

    def slow(history):
        n = history.shape[1] - 1  # committed tokens; the last one is pending
        with torch.no_grad():
            hs = target(history[:, :-1], output_hidden_states=True).hidden_states
            context = head.context(head.fuse([hs[i] for i in head.feature_layers]), torch.arange(n)[None])
            return head.draft_chain(history[:, -1], n, context)[0].tolist()

    assert_drafts_match_recomputation(target, drafter, slow, repetitive_prompt(96, seed=4))


def test_a_nodes_candidates_are_its_own_parents():
    """Two depth-1 candidates, two children each: each pair is the top-2 of U_1 biased by its own
    parent token, and the bias is strong enough here that the two pairs differ."""
    target = tiny_causal_lm("llama", layers=4)
    head = dspark(target, block=3).eval()
    drafter = DSparkDrafter(head, StaticTreeSettings(choices=[(0,), (1,), (0, 0), (0, 1), (1, 0), (1, 1)]))
    prompt = repetitive_prompt(96, seed=3)[:, :12]
    with torch.no_grad():
        out = target(prompt[:, :-1], output_hidden_states=True)
        drafter.begin(prompt[:, :-1], TargetFeatures(out.hidden_states[-1], [out.hidden_states[i] for i in head.feature_layers]), prompt[:, -1])
        tree = drafter.propose()
        context = head.context(head.fuse([out.hidden_states[i] for i in head.feature_layers]), torch.arange(11)[None])
        _, base = head.block_states(prompt[:, -1], 11, context)
        first = head.corrected_logits(base[0, 0], prompt[0, -1]).topk(2).indices.tolist()
        children = [head.corrected_logits(base[0, 1], torch.tensor(t)).topk(2).indices.tolist() for t in first]
    assert tree.tokens[0].tolist() == [int(prompt[0, -1])] + first + children[0] + children[1]
    assert children[0] != children[1]


@pytest.mark.parametrize("family", TARGETS)
def test_greedy_with_dspark_drafting_equals_plain_greedy(family):
    target = tiny_causal_lm(family, layers=4)
    head = dspark(target, block=4).eval()
    assert_greedy_equals_plain(target, lambda **options: DSparkDrafter(head, StaticTreeSettings(**options)))


def test_block_tree_sampling_is_exact_at_depth_two():
    """A static tree over the block: the joint law of three new tokens is the target's."""

    def drafter_of(target, choices):
        config = make_config("dspark", target, None, name="tiny", block_size=2, mask_token_id=VOCAB - 1, markov_rank=4)
        return DSparkDrafter(build_head(config, target).eval(), StaticTreeSettings(choices=choices))

    assert_static_tree_sampling_exact(drafter_of)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_the_confidence_head_sets_the_verify_length_and_never_the_output(family):
    target = tiny_causal_lm(family, layers=4)
    head = dspark(target, block=5).eval()
    prompt = repetitive_prompt(96, seed=11)[:, :10]
    want = plain_greedy(target, prompt, 24)
    # verifying costs a little more per node up to 6 nodes, then much more: at most the block is worth it
    curve = CostCurve((1, 6, 7, 60), (1.0, 2.0, 5.0, 50.0))  # seconds: the drafting time is negligible beside them
    seen = {}
    for name, bias in (("sure", 8.0), ("unsure", -8.0), ("as built", None)):
        if bias is not None:
            with torch.no_grad():
                head.confidence_head.proj.weight.zero_()
                head.confidence_head.proj.bias.fill_(bias)
        else:
            with torch.no_grad():  # a head whose confidence varies with the slot and the token
                head.confidence_head.proj.weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(9))
                head.confidence_head.proj.bias.fill_(-0.5)
        drafter = DSparkDrafter(head)
        set_verify_cost(target, drafter, curve)
        sizes = []
        propose = drafter.propose

        def recording():
            tree = propose()
            sizes.append(tree.num_draft)
            return tree

        drafter.propose = recording
        result = speculative_generate(target, drafter, prompt, GenerationConfig(max_new_tokens=24, sizing="confidence"))
        assert result.new_tokens[0].tolist() == want, name
        seen[name] = sizes
    assert set(seen["sure"]) == {5}  # c ~ 1: the whole block is worth verifying
    assert set(seen["unsure"]) == {1}  # c ~ 0: one draft, the fewest the rule keeps
    assert len(set(seen["as built"])) > 1, seen["as built"]  # the head's own confidences vary the length


def test_confidence_rule_needs_a_confidence_head():
    target = tiny_causal_lm("llama", layers=2)
    config = make_config("dspark", target, None, name="tiny", mask_token_id=MASK, confidence_head=False, confidence_weight=0.0)
    with pytest.raises(ValueError, match="confidence head"):
        DSparkDrafter(build_head(config, target)).size_by(CostCurve((1, 2), (0.1, 0.2)))


def test_dspark_export_is_deepseeks_layout_and_reads_back(tmp_path):
    target = tiny_causal_lm("llama", layers=4)
    head = dspark(target, block=5, aux_layers=(1, 3), num_layers=2)
    out = export_head(head.save_pretrained(tmp_path / "head"), tmp_path / "dspark", "dspark")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3DSparkModel"] and cfg["model_type"] == "qwen3"
    assert cfg["dflash_config"] == {"target_layer_ids": [0, 2], "mask_token_id": MASK}  # layer outputs: ours minus one
    assert (cfg["target_layer_ids"], cfg["mask_token_id"], cfg["block_size"]) == ([0, 2], MASK, 5)
    assert (cfg["markov_rank"], cfg["markov_head_type"], cfg["sample_from_anchor"]) == (8, "vanilla", True)
    assert cfg["enable_confidence_head"] and cfg["confidence_head_with_markov"]
    tensors = load_file(out / "model.safetensors")
    V, H = target.config.vocab_size, target.config.hidden_size
    assert tensors["markov_head.markov_w1.weight"].shape == (V, 8) == tensors["markov_head.markov_w2.weight"].shape
    assert tensors["confidence_head.proj.weight"].shape == (1, H + 8) and tensors["confidence_head.proj.bias"].shape == (1,)
    assert not any(k.startswith(("embed_tokens", "lm_head", "model.")) for k in tensors)
    assert detect_layout(out) == "dspark"
    back = import_head(out, target)
    assert back.config.feature_layers == (1, 3) and back.block_size == 5 and back.config.markov_rank == 8
    for (name, a), (_, b) in zip(head.state_dict().items(), back.state_dict().items()):
        assert torch.equal(a, b), name
    # DeepSeek's own files carry copies of the target's embedding and LM head: checked, then dropped
    tensors.update(
        {
            "embed_tokens.weight": target.get_input_embeddings().weight.detach().clone(),
            "lm_head.weight": target.get_output_embeddings().weight.detach().clone(),
        }
    )
    save_file(tensors, str(out / "model.safetensors"))
    assert torch.equal(import_head(out, target).markov_head.markov_w1.weight, head.markov_head.markov_w1.weight)
    tensors["lm_head.weight"] = tensors["lm_head.weight"] + 1
    save_file(tensors, str(out / "model.safetensors"))
    with pytest.raises(HeadFormatError, match="lm_head.weight differs from the target's"):
        import_head(out, target)
    cfg["markov_head_type"] = "rnn"
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(HeadFormatError, match="vanilla Markov head only"):
        import_head(out, target)


def test_a_saved_head_drafts_with_the_confidence_rule_from_the_cli_value(tmp_path):
    """`--sizing confidence` reaches a saved DSpark head's drafter through the DraftSpec with the
    target's measured verify cost, and decodes exactly."""
    from argparse import Namespace
    from types import SimpleNamespace

    from drafthead.draft_spec import DraftSpec

    target = tiny_causal_lm("llama", layers=4)
    folder = dspark(target, block=4).save_pretrained(tmp_path / "dspark")
    spec = DraftSpec.from_args(Namespace(head=str(folder), sizing="confidence"))
    assert (spec.sizing, spec.num_draft) == ("confidence", None)
    drafting = spec.build(SimpleNamespace(name="tiny", model=target, tokenizer=None), note=lambda line: None)
    assert drafting.verifier is target and (drafting.spec.proposer, drafting.sizing) == ("head", "confidence")
    drafter = drafting.factory()
    assert isinstance(drafter, DSparkDrafter) and drafter.confidence_rule and drafter.verify_cost.nodes[0] == 1
    prompt = repetitive_prompt(96, seed=2)[:, :9]
    result = speculative_generate(target, drafter, prompt, GenerationConfig(max_new_tokens=16, sizing=drafting.sizing))
    assert result.new_tokens[0].tolist() == plain_greedy(target, prompt, 16)
