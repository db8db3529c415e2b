"""Saving and loading heads: round trips, bf16, target identity, and every bad-input case."""

from __future__ import annotations

import copy
import json
import warnings

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from drafthead.heads.eagle3 import Eagle3Head
from drafthead.heads.io import HeadFormatError
from drafthead.ground.target.identity import HeadTargetMismatch
from drafthead.heads.medusa import MedusaHead
from drafthead.heads.registry import build_head, load_head, make_config
from drafthead.ground.target.identity import TargetIdentity, check_compatible, identify_target, tokenizer_fingerprint
from drafthead.heads.io import CONFIG_NAME, WEIGHTS_NAME
from tests.conftest import build_tiny_tokenizer
from tests.tiny import tiny_causal_lm

V = 128
KW = {"medusa1": {"num_heads": 3, "num_layers": 2}, "medusa2": {}, "eagle1": {}, "eagle3": {"draft_vocab_size": 48, "ttt_steps": 2}}


def make_target(family="llama", seed=0, **kw):
    return tiny_causal_lm(family, vocab=V, layers=4, hidden=32, seed=seed, **kw)


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def make_head(kind, target, tok, **kw):
    cfg = make_config(kind, target, tok, name="tiny", **{**KW[kind], **kw})
    head = build_head(cfg, target, token_counts=torch.arange(V) % 7)
    with torch.no_grad():  # trained-looking weights: nothing left at its init
        for p in head.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return head.eval()


def head_outputs(head, target):
    """What inference reads from a head, for a fixed input."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, V, (1, 7), generator=g)
    with torch.no_grad():
        hs = target(ids, output_hidden_states=True).hidden_states
        if isinstance(head, MedusaHead):
            return head.draft_logits(hs[-1][:, -1])
        fused = head.fuse([hs[i] for i in head.feature_layers])
        h, logits = head.step(fused, ids, torch.arange(7)[None])
        return torch.cat([h, logits], -1)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("kind", ["medusa1", "eagle1", "eagle3"])
def test_round_trip_identical_outputs(kind, family, tok, tmp_path):
    target = make_target(family)
    head = make_head(kind, target, tok)
    head.save_pretrained(tmp_path / "h")
    assert sorted(p.name for p in (tmp_path / "h").iterdir()) == [CONFIG_NAME, WEIGHTS_NAME]  # no temp files left
    meta = json.loads((tmp_path / "h" / CONFIG_NAME).read_text())
    assert meta["config"]["kind"] == kind and meta["config"]["target"]["tokenizer_sha"] == tokenizer_fingerprint(tok)
    assert meta["drafthead_version"] and meta["dtype"] == "float32"
    loaded, same_target = load_head(tmp_path / "h", target, tok)
    assert same_target is target and type(loaded) is type(head)
    assert torch.equal(head_outputs(loaded, target), head_outputs(head, target))
    assert loaded.config == head.config
    if kind == "eagle3":
        assert torch.equal(loaded.d2t, head.d2t) and torch.equal(loaded.t2d, head.t2d)


def test_bf16_save(tok, tmp_path):
    target = make_target()
    head = make_head("eagle3", target, tok)
    head.save_pretrained(tmp_path / "h", dtype=torch.bfloat16)
    with safe_open(str(tmp_path / "h" / WEIGHTS_NAME), "pt") as f:
        dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}
    assert dtypes.pop("d2t") == "I64" and dtypes.pop("t2d") == "BOOL"
    assert set(dtypes.values()) == {"BF16"}
    assert json.loads((tmp_path / "h" / CONFIG_NAME).read_text())["dtype"] == "bfloat16"
    assert (tmp_path / "h" / WEIGHTS_NAME).stat().st_size < 0.6 * sum(v.numel() * 4 for v in head.state_dict().values() if v.is_floating_point())
    loaded, _ = load_head(tmp_path / "h", target, tok)  # cast to the fp32 target's dtype
    assert loaded.dtype == torch.float32
    torch.testing.assert_close(head_outputs(loaded, target), head_outputs(head, target), atol=0.1, rtol=0.05)
    bf16_target = make_target().to(torch.bfloat16)
    loaded, _ = load_head(tmp_path / "h", bf16_target, tok)
    assert loaded.dtype == torch.bfloat16
    assert torch.isfinite(head_outputs(loaded, bf16_target).float()).all()


def test_save_is_atomic(tok, tmp_path, monkeypatch):
    target = make_target()
    head = make_head("medusa1", target, tok)
    head.save_pretrained(tmp_path / "h")
    before = head_outputs(load_head(tmp_path / "h", target, tok)[0], target)

    def broken(*a, **k):
        raise OSError("disk full")

    import drafthead.ground.files as files

    monkeypatch.setattr(files, "save_file", broken)
    with torch.no_grad():
        head.blocks[0].layers[0].weight.add_(1.0)
    with pytest.raises(OSError, match="disk full"):
        head.save_pretrained(tmp_path / "h")
    assert sorted(p.name for p in (tmp_path / "h").iterdir()) == [CONFIG_NAME, WEIGHTS_NAME]
    assert torch.equal(head_outputs(load_head(tmp_path / "h", target, tok)[0], target), before)


def test_saved_files_get_the_umask_mode_not_mkstemps_0600(tok, tmp_path):
    import os

    old = os.umask(0o022)
    try:
        make_head("medusa1", make_target(), tok).save_pretrained(tmp_path / "h")
    finally:
        os.umask(old)
    for name in (CONFIG_NAME, WEIGHTS_NAME):
        assert (tmp_path / "h" / name).stat().st_mode & 0o777 == 0o644, name


# ----------------------------------------------------------------------------- bad inputs


@pytest.fixture
def saved(tok, tmp_path):
    target = make_target()
    head = make_head("eagle3", target, tok)
    head.save_pretrained(tmp_path / "h")
    return tmp_path / "h", target


def edit_config(path, fn):
    meta = json.loads((path / CONFIG_NAME).read_text())
    fn(meta)
    (path / CONFIG_NAME).write_text(json.dumps(meta))


def edit_weights(path, fn):
    state = load_file(str(path / WEIGHTS_NAME))
    fn(state)
    save_file(state, str(path / WEIGHTS_NAME))


def test_missing_directory_and_files(saved, tok, tmp_path):
    path, target = saved
    with pytest.raises(HeadFormatError, match="does not exist"):
        load_head(tmp_path / "nope", target, tok)
    (path / WEIGHTS_NAME).unlink()
    with pytest.raises(HeadFormatError, match="missing weights file"):
        load_head(path, target, tok)
    (path / CONFIG_NAME).unlink()
    with pytest.raises(HeadFormatError, match="missing config.json"):
        load_head(path, target, tok)


def test_bad_config(saved, tok):
    path, target = saved
    good = (path / CONFIG_NAME).read_text()
    (path / CONFIG_NAME).write_text(good[:40])
    with pytest.raises(HeadFormatError, match="not valid JSON"):
        load_head(path, target, tok)
    (path / CONFIG_NAME).write_text(good)
    edit_config(path, lambda m: m["config"].update(kind="eagle9"))
    with pytest.raises(HeadFormatError, match="unknown head kind 'eagle9'"):
        load_head(path, target, tok)
    (path / CONFIG_NAME).write_text(good)
    edit_config(path, lambda m: m["config"].update(ttt_stpes=3))
    with pytest.raises(HeadFormatError, match="ttt_stpes"):
        load_head(path, target, tok)
    (path / CONFIG_NAME).write_text(good)
    edit_config(path, lambda m: m["config"]["target"].update(extra=1))
    with pytest.raises(HeadFormatError, match="extra"):
        load_head(path, target, tok)
    (path / CONFIG_NAME).write_text(good)
    edit_config(path, lambda m: m.pop("format"))
    with pytest.raises(HeadFormatError, match="not a drafthead head config"):
        load_head(path, target, tok)


def test_bad_tensors(saved, tok):
    path, target = saved
    good = (path / WEIGHTS_NAME).read_bytes()
    edit_weights(path, lambda s: s.pop("midlayer.hidden_norm.weight"))
    with pytest.raises(HeadFormatError, match="missing tensor.*midlayer.hidden_norm.weight"):
        load_head(path, target, tok)
    (path / WEIGHTS_NAME).write_bytes(good)
    edit_weights(path, lambda s: s.update({"layers.1.extra": torch.zeros(2)}))
    with pytest.raises(HeadFormatError, match="unexpected tensor.*layers.1.extra"):
        load_head(path, target, tok)
    (path / WEIGHTS_NAME).write_bytes(good)
    edit_weights(path, lambda s: s.update({"fc.weight": torch.zeros(32, 64)}))
    with pytest.raises(HeadFormatError, match=r"shape mismatch for fc.weight: expected \(32, 96\)"):
        load_head(path, target, tok)
    (path / WEIGHTS_NAME).write_bytes(good[: len(good) // 2])
    with pytest.raises(HeadFormatError, match="truncated or corrupt"):
        load_head(path, target, tok)
    (path / WEIGHTS_NAME).write_bytes(b"\x00" * 64)
    with pytest.raises(HeadFormatError, match="truncated or corrupt"):
        load_head(path, target, tok)
    (path / WEIGHTS_NAME).write_bytes(good)
    edit_weights(path, lambda s: s.update({"d2t": torch.zeros_like(s["d2t"]) + 5}))
    with pytest.raises(HeadFormatError, match="draft vocab"):
        load_head(path, target, tok)


def test_target_mismatch_lists_every_field(saved, tok):
    path, _ = saved
    other = tiny_causal_lm("qwen2", vocab=V + 32, layers=2, hidden=48)
    other_tok = build_tiny_tokenizer()
    other_tok.add_tokens(["<extra>"])
    with pytest.raises(HeadTargetMismatch) as e:
        load_head(path, other, other_tok)
    msg = str(e.value)
    for field in ("model_type", "vocab_size", "hidden_size", "num_layers", "tokenizer_sha"):
        assert field in msg, field


def test_tokenizer_mismatch_alone_is_an_error(saved, tok):
    path, target = saved
    other_tok = build_tiny_tokenizer()
    other_tok.add_special_tokens({"additional_special_tokens": ["<tool>"]})
    with pytest.raises(HeadTargetMismatch, match="tokenizer_sha"):
        load_head(path, target, other_tok)


def test_name_mismatch_only_warns(saved, tok):
    path, target = saved
    with pytest.warns(UserWarning, match="'tiny'.*'elsewhere'"):
        head, _ = load_head(path, target, tok, target_name="elsewhere")
    assert isinstance(head, Eagle3Head)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_head(path, target, tok)  # same name, tokenizer given: no warning


def test_tokenizer_fingerprint_is_stable_across_save_load(tok, tmp_path):
    from transformers import AutoTokenizer

    tok.save_pretrained(tmp_path / "tok")
    again = AutoTokenizer.from_pretrained(tmp_path / "tok")
    assert tokenizer_fingerprint(again) == tokenizer_fingerprint(tok)
    changed = build_tiny_tokenizer()
    changed.add_tokens(["zzz"])
    assert tokenizer_fingerprint(changed) != tokenizer_fingerprint(tok)


def test_identity_fields_and_check():
    target = make_target("qwen2")
    ident = identify_target(target, None, "x")
    assert ident == TargetIdentity("x", "qwen2", V, 32, 4, None)
    assert TargetIdentity.from_dict(ident.to_dict()) == ident
    with pytest.raises(HeadTargetMismatch, match="hidden_size: head expects 32, target has 64"):
        check_compatible(ident, TargetIdentity("x", "qwen2", V, 64, 4, None))


# ----------------------------------------------------------------------------- medusa2 adapter


def test_medusa2_adapter_is_merged_into_the_target(tok, tmp_path):
    from peft import LoraConfig, get_peft_model

    base = make_target()
    peft_model = get_peft_model(copy.deepcopy(base), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)  # a trained-looking adapter (lora_B starts at zero)
    head = make_head("medusa2", base, tok)
    head.save_pretrained(tmp_path / "h", adapter_model=peft_model)
    assert (tmp_path / "h" / "adapter" / "adapter_config.json").is_file()
    ids = torch.randint(3, V, (1, 9))
    with torch.no_grad():
        want = peft_model(ids).logits
        plain = base(ids).logits
    fresh = make_target()
    head2, adapted = load_head(tmp_path / "h", fresh, tok)
    with torch.no_grad():
        got = adapted(ids).logits
    assert not torch.allclose(plain, want, atol=1e-3)  # the adapter changes the target
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert type(adapted).__name__ == "LlamaForCausalLM"  # merged and unwrapped
    assert head2.refs.lm_head is adapted.get_output_embeddings()
    with pytest.raises(ValueError, match="only medusa2"):
        make_head("medusa1", base, tok).save_pretrained(tmp_path / "x", adapter_model=peft_model)
