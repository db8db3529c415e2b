"""A target's own MTP layer as a head (heads/mtp.py, kind `mtp`), on a tiny DeepSeek-V3 target
whose checkpoint carries one, as DeepSeek-V3's does (`num_nextn_predict_layers: 1`, the layer at
index L after the decoder layers, experts stored one by one).

The checkpoint's MTP layer is written with transformers' own code (a DeepSeek-V3 of L + 1 layers,
saved, its layer L taken), not with ours. The head read from it holds those weights, computes the
MTP forward as it is defined (checked against that layer run by hand), drafts exactly, fine-tunes
from them through `drafthead train`'s builder, and exports back to exactly the checkpoint's tensors.
"""
from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors import safe_open

from drafthead.heads.formats import export_head
from drafthead.heads.registry import build_head, make_config
from drafthead.inference.drafters.load import head_drafter
from drafthead.inference.engine.drafter import fork_drafter
from drafthead.inference.engine.generate import GenerationConfig, speculative_generate
from drafthead.inference.engine.targets import load_target
from tests.oracle import assert_accepts_and_stays_exact
from tests.tiny import left_padded, plain_greedy, prompts_of, repetitive_prompt
from tests.tiny_mtp import save_tiny_mtp_target

L, NEW = 4, 16


@pytest.fixture(scope="module")
def mtp_target(tmp_path_factory):
    """(folder, the L + 1 layer model whose layer L is the MTP block, the MTP layer's own tensors)."""
    return save_tiny_mtp_target(tmp_path_factory.mktemp("ds"), L)


def mtp_head(folder):
    loaded = load_target(folder)
    return build_head(make_config("mtp", loaded.model, loaded.tokenizer), loaded.model, dtype=torch.float32), loaded


def test_the_head_is_the_checkpoints_mtp_layer(mtp_target):
    folder, longer, tensors = mtp_target
    head, loaded = mtp_head(folder)
    mine = head.layers[0].state_dict()
    theirs = longer.model.layers[L].state_dict()
    assert set(mine) == set(theirs) and all(torch.equal(mine[k], theirs[k]) for k in mine)  # experts fused as transformers does
    assert torch.equal(head.fc.weight, tensors[f"model.layers.{L}.eh_proj.weight"])

    # the MTP forward as defined, by hand: block(eh_proj(cat(enorm(e), hnorm(f)))), its own norm, the LM head
    target = loaded.model
    ids = torch.randint(3, 96, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        f = target(ids, output_hidden_states=True).hidden_states[-1]  # the final normed state
        nxt = torch.roll(ids, -1, 1)
        positions = torch.arange(9)[None]
        e = target.get_input_embeddings()(nxt).masked_fill((positions == 0)[..., None], 0.0)

        def rms(x, w):
            return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + target.config.rms_norm_eps)

        p = f"model.layers.{L}."
        x = torch.cat([rms(e, tensors[p + "enorm.weight"]), rms(f, tensors[p + "hnorm.weight"])], -1) @ tensors[p + "eh_proj.weight"].T
        rotary = longer.model.rotary_emb(x, positions)
        mask = torch.full((9, 9), float("-inf")).triu(1)[None, None]
        h = longer.model.layers[L](x, attention_mask=mask, position_ids=positions, position_embeddings=rotary)
        h = h[0] if isinstance(h, tuple) else h
        logits = rms(h, tensors[p + "shared_head.norm.weight"]) @ tensors[p + "shared_head.head.weight"].T
        _, ours = head.step(f, nxt, positions)
    torch.testing.assert_close(ours, logits, atol=1e-5, rtol=1e-4)


def test_mtp_drafts_exactly_untrained(mtp_target):
    folder, _, _ = mtp_target
    head, loaded = mtp_head(folder)
    target = loaded.model
    prompt = repetitive_prompt(96, length=14, seed=4)
    reference = plain_greedy(target, prompt, NEW)
    assert speculative_generate(target, head_drafter(head), prompt, GenerationConfig(max_new_tokens=NEW)).new_tokens[0].tolist() == reference
    prompts = prompts_of((1, 6, 13), seed=2)
    references = [plain_greedy(target, p[None], NEW) for p in prompts]
    ids, mask = left_padded(prompts)
    batched = speculative_generate(target, head_drafter(head), ids, GenerationConfig(max_new_tokens=NEW), attention_mask=mask)
    assert [row.new_tokens[0].tolist() for row in batched.rows] == references
    drafter = head_drafter(head)
    assert_accepts_and_stays_exact(target, lambda: fork_drafter(drafter), prompt, reference, prompts, references, ids, mask,
                                   NEW, NEW, lambda new: GenerationConfig(max_new_tokens=new))


def test_mtp_fine_tunes_from_the_checkpoints_layer_and_exports_back(mtp_target, tmp_path):
    from drafthead.train.tiny import write_tiny_jsonl
    from tests.tiny_training import train_three_steps

    folder, _, tensors = mtp_target
    head, loaded = mtp_head(folder)
    untrained = tmp_path / "untrained"
    head.save_pretrained(untrained)
    out = export_head(untrained, tmp_path / "export", "mtp", target_model=loaded.model)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        written = {k: f.get_tensor(k) for k in f.keys()}
    assert set(written) == set(tensors) and all(torch.equal(written[k], tensors[k]) for k in tensors)
    written_config = json.loads((out / "config.json").read_text())
    assert written_config["num_nextn_predict_layers"] == 1 and written_config["topk_method"] == "noaux_tc"

    chats = write_tiny_jsonl(tmp_path / "chats.jsonl", 16)
    result, losses = train_three_steps(folder, loaded, {"kind": "mtp"}, chats, tmp_path / "run", "tiny-ds")
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses), losses
    from drafthead.inference.drafters.load import load_head_drafter

    drafter, target = load_head_drafter(result.final_dir, loaded.model, loaded.tokenizer, target_name="tiny-ds")
    trained = drafter.head.fc.weight
    assert not torch.equal(trained, head.fc.weight)  # it trained, from the checkpoint's layer
    prompt = repetitive_prompt(96, length=14, seed=4)
    assert speculative_generate(target, drafter, prompt, GenerationConfig(max_new_tokens=NEW)).new_tokens[0].tolist() == \
        plain_greedy(target, prompt, NEW)
