"""P-EAGLE (heads/peagle.py, inference/drafters/parallel.py): the COD-sampled loss equals a slow
element-by-element twin that drafts each element the way inference does, the cached drafter
equals drafting from scratch, and decoding with it is exact (greedy and sampling at depth 2)."""

import json
import pytest
import torch

from drafthead.inference.drafters.settings import StaticTreeSettings
from drafthead.heads.config import PEagleConfig
from drafthead.heads.peagle import cod_columns, parallel_attention_mask
from drafthead.heads.registry import build_head, make_config
from drafthead.inference.drafters.parallel import ParallelDrafter
from tests.head_checks import assert_drafts_match_recomputation, assert_greedy_equals_plain
from tests.head_checks import element_loss, target_feature_batch
from tests.law import assert_static_tree_sampling_exact
from tests.tiny import TARGETS, repetitive_prompt, tiny_causal_lm


def peagle(target, depth=4, **extra):
    config = make_config("peagle", target, None, name="tiny", draft_vocab_size=64, parallel_depth=depth, mask_token_id=2, **extra)
    return build_head(config, target, token_counts=torch.arange(target.config.get_text_config().vocab_size))


def test_cod_columns_are_nested_shrinking_and_sorted():
    columns = cod_columns(50, 6, 0.8, 0.2, generator=torch.Generator().manual_seed(0))
    assert columns[0].tolist() == list(range(50))
    sizes = [c.numel() for c in columns]
    assert sizes == [50] + [max(1, round(max(0.8**d, 0.2) * 50)) for d in range(1, 6)] == [50, 40, 32, 26, 20, 16]
    for shallow, deep in zip(columns, columns[1:]):
        assert set(deep.tolist()) <= set(shallow.tolist())
        assert deep.tolist() == sorted(deep.tolist())


def test_parallel_mask_lets_an_element_see_its_context_and_its_own_chain():
    columns = [torch.arange(5), torch.tensor([1, 3, 4]), torch.tensor([1, 4])]
    allowed = parallel_attention_mask(5, columns, torch.float32)[0, 0] == 0  # [2, 5 + 3 + 2]
    # the slow rule, key by key: (column, depth) of each key in cache order
    keys = [(c, 0) for c in range(5)] + [(c, 1) for c in (1, 3, 4)] + [(c, 2) for c in (1, 4)]
    for row, query in enumerate((1, 4)):
        want = [(depth == 0 and col <= query) or (depth > 0 and col == query) for col, depth in keys]
        assert allowed[row].tolist() == want


def slow_loss(head, batch, seed):
    """The loss element by element: each kept (row b, column t, depth d) is drafted from scratch
    the way inference drafts it (the pairs 0..t and d mask positions, one causal forward) and scored
    against the target's distribution for token t + 2 + d."""
    cfg = head.config
    ids = batch.input_ids
    B, T = ids.shape
    torch.manual_seed(seed)
    columns = cod_columns(T, cfg.parallel_depth, cfg.cod_ratio, cfg.cod_min_ratio)
    target_p = head._target_distribution(batch)
    fused = head.fuse([batch.hidden_states[i] for i in cfg.feature_layers])
    total, n = 0.0, 0
    for d, cols in enumerate(columns):
        for b in range(B):
            for t in cols.tolist():
                label = t + 2 + d
                if label >= T or not batch.loss_mask[b, label]:
                    continue
                logits = head.parallel_draft(fused[b : b + 1, : t + 1], ids[b : b + 1, 1 : t + 2], torch.arange(t + 1)[None], head.new_cache())
                log_q = torch.log_softmax(logits[0, d].float(), dim=-1)
                total = total + element_loss(log_q, target_p[b, t + 1 + d], cfg.loss)
                n += 1
    return total / n


@pytest.mark.parametrize("extra", [{}, {"fc_norm": True, "norm_output": True}, {"loss": "lk_alpha"}])
def test_loss_equals_the_element_by_element_twin(extra):
    target = tiny_causal_lm("llama", layers=3)
    head = peagle(target, depth=4, cod_ratio=0.6, cod_min_ratio=0.3, **extra)
    batch = target_feature_batch(target)
    torch.manual_seed(5)
    loss, metrics = head.compute_loss(batch)
    assert metrics["elements_3"] < metrics["elements_0"]  # COD trained fewer deep elements
    with torch.no_grad():
        want = slow_loss(head, batch, seed=5)
    assert torch.allclose(loss, want, atol=1e-5), (loss.item(), want.item())
    loss.backward()  # the mask embedding and the feature placeholder learn
    assert head.mask_embedding.grad.abs().sum() > 0 and head.mask_hidden.grad.abs().sum() > 0


def test_config_needs_a_mask_token_inside_the_vocabulary():
    target = tiny_causal_lm("llama")
    with pytest.raises(ValueError, match="mask_token_id"):
        make_config("peagle", target, None, name="tiny")
    with pytest.raises(ValueError, match="outside the target vocabulary"):
        make_config("peagle", target, None, name="tiny", mask_token_id=96)
    assert PEagleConfig.from_dict(make_config("peagle", target, None, mask_token_id=5).to_dict()).mask_token_id == 5


def test_cached_drafting_equals_drafting_from_scratch_across_rounds():
    target = tiny_causal_lm("qwen2", layers=4)
    head = peagle(target, depth=4).eval()
    drafter = ParallelDrafter(head)  # the top-1 chain over 4 depths

    def slow(history):
        with torch.no_grad():
            hs = target(history[:, :-1], output_hidden_states=True).hidden_states
            fused = head.fuse([hs[i] for i in head.feature_layers])
            logits = head.parallel_draft(fused, history[:, 1:], torch.arange(history.shape[1] - 1)[None], head.new_cache())
        ids = logits[0].argmax(-1)
        return (ids + head.draft_to_target[ids]).tolist()

    assert_drafts_match_recomputation(target, drafter, slow, repetitive_prompt(96, seed=4))


@pytest.mark.parametrize("family", TARGETS)
def test_greedy_with_parallel_drafting_equals_plain_greedy(family):
    target = tiny_causal_lm(family, layers=4)
    head = peagle(target, depth=3).eval()
    assert_greedy_equals_plain(target, lambda **options: ParallelDrafter(head, StaticTreeSettings(**options)))


def test_parallel_tree_sampling_is_exact_at_depth_two():
    """A static tree over the parallel depths: the joint law of three new tokens is the target's
    (ten rows a batch)."""

    def drafter_of(target, choices):
        config = make_config("peagle", target, None, name="tiny", aux_layers=(1, 2, 3), parallel_depth=3, mask_token_id=2)
        return ParallelDrafter(build_head(config, target).eval(), StaticTreeSettings(choices=choices))

    assert_static_tree_sampling_exact(drafter_of)


def test_speculators_export_carries_the_mask_row_and_placeholder_and_reads_back(tmp_path):
    from safetensors.torch import load_file

    from drafthead.heads.formats import export_head, import_head
    from drafthead.heads.io import HeadFormatError

    target = tiny_causal_lm("llama", layers=4)
    head = peagle(target, depth=3, aux_layers=(1, 2, 3))
    with torch.no_grad():
        head.mask_embedding.add_(1.0)  # as training leaves it: no longer the target's row
    saved = head.save_pretrained(tmp_path / "head")
    out = export_head(saved, tmp_path / "spec", "speculators", target_model=target)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["speculators_model_type"] == "peagle" and cfg["mask_token_id"] == 2
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    tensors = load_file(out / "model.safetensors")
    assert tensors["mask_hidden"].shape == (1, 1, 3 * 32)
    embed, own = tensors["embed_tokens.weight"], target.get_input_embeddings().weight
    assert torch.equal(embed[2], head.mask_embedding.detach())
    assert torch.equal(torch.cat([embed[:2], embed[3:]]), torch.cat([own[:2], own[3:]]))
    back = import_head(out, target)
    assert back.kind == "peagle" and back.config.parallel_depth == 3
    for (name, a), (_, b) in zip(head.state_dict().items(), back.state_dict().items()):
        assert torch.equal(a, b), name
    # another row changed: the checkpoint was made against another target
    embed[5] += 1.0
    from safetensors.torch import save_file

    save_file(tensors, out / "model.safetensors")
    with pytest.raises(HeadFormatError, match="embed_tokens.weight differs"):
        import_head(out, target)
