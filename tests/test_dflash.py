"""DFlash (heads/dflash.py, inference/drafters/parallel.py): the many-block training loss equals a
slow block-by-block twin that drafts each block the way inference does, the cached drafter equals
drafting from scratch, and decoding with it is exact (greedy at batch 1 and 3, sampling at depth 2)."""

import math

import pytest
import torch

from drafthead.inference.drafters.settings import StaticTreeSettings
from drafthead.heads.batch import FeatureBatch
from drafthead.heads.config import DFlashConfig
from drafthead.heads.dflash import block_attention_mask, sample_anchors
from drafthead.heads.registry import build_head, make_config
from drafthead.inference.drafters.parallel import DFlashDrafter
from tests.head_checks import assert_drafts_match_recomputation, assert_greedy_equals_plain
from tests.law import VOCAB, assert_static_tree_sampling_exact
from tests.tiny import TARGETS, repetitive_prompt, tiny_causal_lm
from tests.head_checks import element_loss


MASK = 95  # not 2, the tiny models' pad token: its embedding row is zero (test_a_zero_mask_embedding_is_refused)


def dflash(target, block=4, **extra):
    config = make_config("dflash", target, None, name="tiny", block_size=block, mask_token_id=MASK, **extra)
    return build_head(config, target)


def test_anchors_have_context_and_a_label_after_them():
    label_ok = torch.tensor([[0, 1, 1, 1, 0, 1, 1, 0], [0, 0, 0, 1, 0, 0, 0, 0]], dtype=torch.bool)
    anchors, ok = sample_anchors(label_ok, 3, generator=torch.Generator().manual_seed(0))
    assert anchors.shape == (2, 3)
    # row 0: p in 1..6 with label_ok[p + 1]: {1, 2, 4, 5}, three of them, sorted; row 1: only p = 2
    row0 = anchors[0][ok[0]].tolist()
    assert len(row0) == 3 and set(row0) <= {1, 2, 4, 5} and row0 == sorted(row0)
    assert anchors[1][ok[1]].tolist() == [2] and ok[1].tolist() == [True, False, False]


def test_block_mask_sees_the_context_before_its_anchor_and_its_own_block():
    anchors = torch.tensor([[2, 5]])
    allowed = block_attention_mask(7, anchors, 3, torch.float32)[0, 0] == 0  # [6, 7 + 6]
    for q in range(6):
        block = q // 3
        want = [s < int(anchors[0, block]) for s in range(7)] + [j // 3 == block for j in range(6)]
        assert allowed[q].tolist() == want


def _batch(target, B=3, T=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, target.config.vocab_size, (B, T), generator=g)
    loss_mask = torch.rand(B, T, generator=g) > 0.3
    attention = torch.ones_like(ids)
    attention[1, 12:] = 0  # a right-padded row
    with torch.no_grad():
        hs = target(ids, attention_mask=attention, output_hidden_states=True).hidden_states
    return FeatureBatch(ids, attention, loss_mask, {i: h for i, h in enumerate(hs)})


def slow_loss(head, batch, anchors, ok):
    """Block by block: each anchor a's block is drafted from scratch as inference drafts it (the
    fused features of positions 0..a-1 as context, one block after them) and its k-th token scored
    against the target's distribution for token a + k, weighted exp(-(k - 1) / gamma)."""
    cfg = head.config
    ids = batch.input_ids
    B, T = ids.shape
    label_ok = batch.loss_mask.bool() & batch.attention_mask.bool()
    fused = head.fuse([batch.hidden_states[i] for i in cfg.feature_layers])
    lm = head.refs.lm_head.weight
    total, weight = 0.0, 0.0
    for b in range(B):
        for j in range(anchors.shape[1]):
            if not ok[b, j]:
                continue
            a = int(anchors[b, j])
            context = head.context(fused[b : b + 1, :a], torch.arange(a)[None])
            logits = head.draft_logits(ids[b, a : a + 1], a, context)[0]  # [S - 1, V]
            for k in range(1, cfg.block_size):
                if a + k >= T or not label_ok[b, a + k]:
                    continue
                p = torch.softmax(batch.hidden_states[cfg.final_layer][b, a + k - 1] @ lm.T, dim=-1)
                w = 1.0 if cfg.loss_decay_gamma is None else math.exp(-(k - 1) / cfg.loss_decay_gamma)
                total = total + w * element_loss(torch.log_softmax(logits[k - 1], dim=-1), p, cfg.loss)
                weight += w
    return total / weight


@pytest.mark.parametrize("extra", [{"num_layers": 1}, {"num_layers": 2, "loss_decay_gamma": None}, {"loss": "lk_alpha"}])
def test_loss_equals_the_block_by_block_twin(extra):
    target = tiny_causal_lm("llama", layers=3)
    head = dflash(target, block=4, num_anchors=5, **extra)
    batch = _batch(target)
    label_ok = batch.loss_mask.bool() & batch.attention_mask.bool()
    anchors, ok = sample_anchors(label_ok, head.config.num_anchors, generator=torch.Generator().manual_seed(1))
    loss, metrics = head.block_loss(batch, anchors, ok)
    with torch.no_grad():
        want = slow_loss(head, batch, anchors, ok)
    assert torch.allclose(loss, want, atol=1e-5), (loss.item(), want.item())
    assert metrics["num_labels"] > 0 and {"acc_0", "acc_1", "acc_2"} <= set(metrics)
    loss.backward()
    assert head.fc.weight.grad.abs().sum() > 0 and head.layers[0].self_attn.k_norm.weight.grad.abs().sum() > 0
    assert head.refs.lm_head.weight.grad is None  # the target's LM head stays frozen


def test_config_checks_the_mask_token_and_the_feature_layers():
    target = tiny_causal_lm("llama", layers=4)
    with pytest.raises(ValueError, match="mask_token_id"):
        make_config("dflash", target, None, name="tiny")
    with pytest.raises(ValueError, match="outside the target vocabulary"):
        make_config("dflash", target, None, name="tiny", mask_token_id=96)
    with pytest.raises(ValueError, match="decoder-layer outputs"):  # 4 is the final normed state
        make_config("dflash", target, None, name="tiny", mask_token_id=2, aux_layers=(1, 4))
    with pytest.raises(ValueError, match="block_size"):
        make_config("dflash", target, None, name="tiny", mask_token_id=2, block_size=1)
    config = make_config("dflash", target, None, name="tiny", mask_token_id=MASK)
    assert config.feature_layers == (1, 2, 3)  # EAGLE-3's, all decoder-layer outputs on 4 layers
    assert DFlashConfig.from_dict(config.to_dict()) == config


def test_a_zero_mask_embedding_is_refused():
    """Every mask position would read a zero vector: its queries vanish and its attention is
    uniform, so the head could not learn (the tiny models' pad row is zero)."""
    target = tiny_causal_lm("llama", layers=3)
    with pytest.raises(ValueError, match="embedding row of mask_token_id 2 is zero"):
        build_head(make_config("dflash", target, None, name="tiny", mask_token_id=2), target)


def test_cached_drafting_equals_drafting_from_scratch_across_rounds():
    target = tiny_causal_lm("qwen2", layers=4)
    head = dflash(target, block=5).eval()
    drafter = DFlashDrafter(head)  # the top-1 chain of 4 tokens

    def slow(history):
        n = history.shape[1] - 1  # committed tokens; the last one is pending
        with torch.no_grad():
            hs = target(history[:, :-1], output_hidden_states=True).hidden_states
            context = head.context(head.fuse([hs[i] for i in head.feature_layers]), torch.arange(n)[None])
            logits = head.draft_logits(history[:, -1], n, context)
        return logits[0].argmax(-1).tolist()

    assert_drafts_match_recomputation(target, drafter, slow, repetitive_prompt(96, seed=4))


@pytest.mark.parametrize("family", TARGETS)
def test_greedy_with_block_drafting_equals_plain_greedy(family):
    target = tiny_causal_lm(family, layers=4)
    head = dflash(target, block=4).eval()
    assert_greedy_equals_plain(target, lambda **options: DFlashDrafter(head, StaticTreeSettings(**options)))


def test_block_tree_sampling_is_exact_at_depth_two():
    """A static tree over the block's positions: the joint law of three new tokens is the target's."""

    def drafter_of(target, choices):
        config = make_config("dflash", target, None, name="tiny", block_size=3, mask_token_id=VOCAB - 1)
        return DFlashDrafter(build_head(config, target).eval(), StaticTreeSettings(choices=choices))

    assert_static_tree_sampling_exact(drafter_of)


def test_dflash_export_is_the_engines_layout_and_reads_back(tmp_path):
    import json

    from safetensors.torch import load_file

    from drafthead.heads.formats import detect_layout, export_head, import_head

    target = tiny_causal_lm("llama", layers=4)
    head = dflash(target, block=5, aux_layers=(1, 3), num_layers=2)
    out = export_head(head.save_pretrained(tmp_path / "head"), tmp_path / "dflash", "dflash")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    # layer-output ids (ours minus one), the block and the mask token where every reader looks
    assert cfg["dflash_config"] == {"target_layer_ids": [0, 2], "mask_token_id": MASK}
    assert (cfg["block_size"], cfg["num_target_layers"], cfg["num_hidden_layers"]) == (5, 4, 2)
    assert cfg["rope_theta"] == target.config.rope_parameters["rope_theta"]  # the readers' defaults differ
    tensors = load_file(out / "model.safetensors")
    assert "fc.weight" in tensors and not any(k.startswith(("embed_tokens", "lm_head", "model.")) for k in tensors)
    assert detect_layout(out) == "dflash"
    back = import_head(out, target)
    assert back.config.feature_layers == (1, 3) and back.block_size == 5
    for (name, a), (_, b) in zip(head.state_dict().items(), back.state_dict().items()):
        assert torch.equal(a, b), name
    with pytest.raises(ValueError, match="not dflash .a dflash head exports as: dflash"):
        export_head(tmp_path / "head", tmp_path / "vllm", "vllm")
