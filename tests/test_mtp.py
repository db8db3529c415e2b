"""A target's own MTP layer as a head (heads/mtp.py, kind `mtp`), on tiny DeepSeek-V3 and
Qwen3-Next targets whose checkpoints carry one, as the released ones do (tests/tiny_mtp.py: written
with transformers' own code, not with ours).

The head read from a checkpoint holds its weights, computes the MTP forward as it is defined
(checked against the block run by hand), drafts exactly (Qwen3-Next: through the hybrid backend's
chains), fine-tunes from them through `drafthead train`'s builder, and exports back to exactly the
checkpoint's tensors.
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
from drafthead.ground.target.load import load_target
from tests.oracle import assert_accepts_and_stays_exact
from tests.tiny import left_padded, plain_greedy, prompts_of, repetitive_prompt
from tests.tiny_mtp import save_tiny_mtp_target

L, NEW = 4, 16


FAMILIES = ("deepseek_v3", "glm4_moe", "qwen3_next")


@pytest.fixture(scope="module", params=FAMILIES)
def mtp_target(request, tmp_path_factory):
    return save_tiny_mtp_target(tmp_path_factory.mktemp(request.param), request.param, L)


def mtp_head(folder):
    loaded = load_target(folder)
    return build_head(make_config("mtp", loaded.model, loaded.tokenizer), loaded.model, dtype=torch.float32), loaded


def test_the_head_is_the_checkpoints_mtp_layer(mtp_target):
    ck = mtp_target
    head, loaded = mtp_head(ck.folder)
    mine = head.layers[0].state_dict()
    theirs = ck.block.state_dict()
    assert set(mine) == set(theirs) and all(torch.equal(mine[k], theirs[k]) for k in mine)  # experts fused as transformers does
    assert torch.equal(head.fc.weight, ck.tensors[ck.names["proj"]])

    # the MTP forward as defined, by hand: block(proj(cat(enorm(e), hnorm(f)))), its own norm, the LM head
    target = loaded.model
    eps = target.config.rms_norm_eps
    ids = torch.randint(3, 96, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        f = target(ids, output_hidden_states=True).hidden_states[-1]  # the final normed state
        nxt = torch.roll(ids, -1, 1)
        positions = torch.arange(9)[None]
        e = target.get_input_embeddings()(nxt)
        if ck.zero_first:
            e = e.masked_fill((positions == 0)[..., None], 0.0)
        t = ck.tensors
        x = torch.cat([ck.norm(e, t[ck.names["enorm"]], eps), ck.norm(f, t[ck.names["hnorm"]], eps)], -1) @ t[ck.names["proj"]].T
        mask = torch.full((9, 9), float("-inf")).triu(1)[None, None]
        h = ck.block(x, attention_mask=mask, position_ids=positions, position_embeddings=ck.rotary(x, positions))
        h = h[0] if isinstance(h, tuple) else h
        head_weight = t[ck.names["head"]] if ck.names["head"] else target.get_output_embeddings().weight
        normed = ck.norm(h, t[ck.names["norm"]], eps)
        logits = normed @ head_weight.T
        feature, ours = head.step(f, nxt, positions)
    torch.testing.assert_close(ours, logits, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(feature, normed if ck.recycle_normed else h, atol=1e-5, rtol=1e-4)  # what the next step takes


def test_mtp_drafts_exactly_untrained(mtp_target):
    head, loaded = mtp_head(mtp_target.folder)
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
    assert_accepts_and_stays_exact(
        target,
        lambda: fork_drafter(drafter),
        prompt,
        reference,
        prompts,
        references,
        ids,
        mask,
        NEW,
        NEW,
        lambda new: GenerationConfig(max_new_tokens=new),
        chain=target.config.model_type == "qwen3_next",
    )


def test_mtp_fine_tunes_from_the_checkpoints_layer_and_exports_back(mtp_target, tmp_path):
    from drafthead.train.data.tiny import write_tiny_jsonl
    from tests.tiny_training import train_three_steps

    folder, tensors = mtp_target.folder, mtp_target.tensors
    head, loaded = mtp_head(folder)
    untrained = tmp_path / "untrained"
    head.save_pretrained(untrained)
    out = export_head(untrained, tmp_path / "export", "mtp", target_model=loaded.model)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        written = {k: f.get_tensor(k) for k in f.keys()}
    assert set(written) == set(tensors) and all(torch.equal(written[k], tensors[k]) for k in tensors)
    written_config = json.loads((out / "config.json").read_text())
    on_disk = json.loads((folder / "config.json").read_text())  # the target's config as its folder has it
    assert {k: v for k, v in written_config.items() if k not in ("topk_method", "torch_dtype", "drafthead")} == {
        k: v for k, v in on_disk.items() if k not in ("topk_method", "torch_dtype")
    }
    assert written_config["num_nextn_predict_layers"] == 1
    bias = any(k.endswith("e_score_correction_bias") for k in tensors)  # DeepSeek's and GLM's routing
    assert written_config.get("topk_method") == ("noaux_tc" if bias else None)

    chats = write_tiny_jsonl(tmp_path / "chats.jsonl", 16)
    result, losses = train_three_steps(folder, loaded, {"kind": "mtp"}, chats, tmp_path / "run", "tiny-mtp")
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses), losses
    from drafthead.inference.drafters.load import load_head_drafter

    drafter, target = load_head_drafter(result.final_dir, loaded.model, loaded.tokenizer, target_name="tiny-mtp")
    trained = drafter.head.fc.weight
    assert not torch.equal(trained, head.fc.weight)  # it trained, from the checkpoint's layer
    prompt = repetitive_prompt(96, length=14, seed=4)
    assert speculative_generate(target, drafter, prompt, GenerationConfig(max_new_tokens=NEW)).new_tokens[0].tolist() == plain_greedy(
        target, prompt, NEW
    )


def test_a_checkpoint_without_its_mtp_layer_says_so(mtp_target, tmp_path):
    """The same folder with the MTP layer's tensors taken out: the head still builds (a new layer
    from the last decoder layer), with one warning that it is not the target's own."""
    import shutil

    from safetensors.torch import load_file, save_file

    folder = tmp_path / "no-mtp"
    shutil.copytree(mtp_target.folder, folder)
    for f in folder.glob("*.safetensors"):
        kept = {k: v for k, v in load_file(str(f)).items() if k not in set(mtp_target.tensors)}
        save_file(kept, str(f), metadata={"format": "pt"})
    with pytest.warns(UserWarning, match="holds no MTP layer"):
        mtp_head(folder)
