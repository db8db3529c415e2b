"""Export to the vLLM / SGLang layouts (keys, shapes, dtypes, config) and import back."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from drafthead.cli import main as cli_main
from drafthead.heads import HeadFormatError, build_head, make_config
from drafthead.heads.export import detect_layout, export_head, import_head
from drafthead.heads.io import CONFIG_NAME, WEIGHTS_NAME
from tests.tiny import tiny_causal_lm

V, H, L = 128, 32, 4


def make_target(family="llama"):
    return tiny_causal_lm(family, vocab=V, layers=L, hidden=H)


def saved_head(kind, target, path, **kw):
    cfg = make_config(kind, target, None, name="tiny", **kw)
    head = build_head(cfg, target, token_counts=(torch.arange(V) * 7919) % 101)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(0.05 * torch.randn_like(p))
    head.eval().save_pretrained(path)
    return head


def outputs(head, target):
    ids = torch.randint(3, V, (1, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hs = target(ids, output_hidden_states=True).hidden_states
        if hasattr(head, "draft_logits"):
            return head.draft_logits(hs[-1][:, -1])
        h, logits = head.step(head.fuse([hs[i] for i in head.feature_layers]), ids, torch.arange(6)[None])
        return torch.cat([h, logits], -1)


def read(out):
    cfg = json.loads((out / CONFIG_NAME).read_text())
    with safe_open(str(out / WEIGHTS_NAME), "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}
    return cfg, shapes, dtypes


# ----------------------------------------------------------------------------- EAGLE-3


@pytest.mark.parametrize("fmt", ["vllm", "sglang"])
def test_eagle3_layout(fmt, tmp_path):
    target = make_target()
    head = saved_head("eagle3", target, tmp_path / "h", draft_vocab_size=40, aux_layers=(1, 2, 3))
    out = export_head(tmp_path / "h", tmp_path / fmt, fmt)
    cfg, shapes, dtypes = read(out)
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["model_type"] == "llama"
    assert cfg["num_hidden_layers"] == 1 and cfg["draft_vocab_size"] == 40 and cfg["vocab_size"] == V
    assert cfg["target_hidden_size"] == H and cfg["hidden_size"] == H
    # our output_hidden_states indices == vLLM's "input of decoder layer idx": written unchanged
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert cfg["num_attention_heads"] == 4 and cfg["num_key_value_heads"] == 2 and cfg["intermediate_size"] == 64
    assert cfg["rope_theta"] == target.config.rope_parameters["rope_theta"]
    assert cfg["attention_bias"] is False and cfg["torch_dtype"] == "float32"
    assert shapes["fc.weight"] == (H, 3 * H)
    assert shapes["lm_head.weight"] == (40, H)
    assert shapes["norm.weight"] == (H,)
    assert shapes["d2t"] == (40,) and dtypes["d2t"] == "I64"
    assert shapes["t2d"] == (V,) and dtypes["t2d"] == "BOOL"
    assert shapes["midlayer.self_attn.q_proj.weight"] == (H, 2 * H)  # cat(embeds, hidden)
    assert shapes["midlayer.self_attn.k_proj.weight"] == (H // 2, 2 * H)
    assert shapes["midlayer.hidden_norm.weight"] == (H,)
    expected = {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} | {
        f"midlayer.{k}" for k in head.midlayer.state_dict()
    }
    assert set(shapes) == expected
    d2t = load_file(str(out / WEIGHTS_NAME))["d2t"]
    assert torch.equal(d2t, head.d2t) and bool(d2t.any())  # not the all-zero bug
    back = import_head(out, target)
    assert torch.equal(outputs(back, target), outputs(head, target))


def test_eagle3_qwen2_gets_zero_o_proj_bias_and_round_trips(tmp_path):
    target = make_target("qwen2")
    head = saved_head("eagle3", target, tmp_path / "h", draft_vocab_size=40)
    out = export_head(tmp_path / "h", tmp_path / "v", "vllm")
    cfg, shapes, _ = read(out)
    assert cfg["attention_bias"] is True  # Llama's flag: bias on q/k/v *and* o_proj
    state = load_file(str(out / WEIGHTS_NAME))
    assert shapes["midlayer.self_attn.q_proj.bias"] == (H,)
    assert torch.equal(state["midlayer.self_attn.o_proj.bias"], torch.zeros(H))
    back = import_head(out, target)
    assert torch.equal(outputs(back, target), outputs(head, target))
    state["midlayer.self_attn.o_proj.bias"] += 1.0
    save_file(state, str(out / WEIGHTS_NAME))
    with pytest.raises(HeadFormatError, match="non-zero"):
        import_head(out, target)


def test_bf16_export(tmp_path):
    target = make_target()
    saved_head("eagle3", target, tmp_path / "h", draft_vocab_size=40)
    cfg, _, dtypes = read(export_head(tmp_path / "h", tmp_path / "v", "vllm", dtype=torch.bfloat16))
    assert cfg["torch_dtype"] == "bfloat16"
    assert dtypes.pop("d2t") == "I64" and dtypes.pop("t2d") == "BOOL"
    assert set(dtypes.values()) == {"BF16"}


def test_foreign_eagle3_checkpoint_imports_by_shape(tmp_path):
    """A checkpoint from another trainer has no `drafthead` block: config comes from the file."""
    target = make_target()
    head = saved_head("eagle3", target, tmp_path / "h", draft_vocab_size=40)
    out = export_head(tmp_path / "h", tmp_path / "v", "vllm")
    cfg = json.loads((out / CONFIG_NAME).read_text())
    del cfg["drafthead"]
    (out / CONFIG_NAME).write_text(json.dumps(cfg))
    back = import_head(out, target)
    assert back.config.feature_layers == head.config.feature_layers and back.config.draft_vocab_size == 40
    assert torch.equal(outputs(back, target), outputs(head, target))


def test_import_checks_target_identity(tmp_path):
    target = make_target()
    saved_head("eagle3", target, tmp_path / "h", draft_vocab_size=40)
    out = export_head(tmp_path / "h", tmp_path / "v", "vllm")
    from drafthead.heads import HeadTargetMismatch

    with pytest.raises(HeadTargetMismatch, match="num_layers"):
        import_head(out, tiny_causal_lm("llama", vocab=V, layers=3, hidden=H))


# ----------------------------------------------------------------------------- EAGLE-1 and Medusa


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_eagle1_layout(family, tmp_path):
    target = make_target(family)
    head = saved_head("eagle1", target, tmp_path / "h")
    out = export_head(tmp_path / "h", tmp_path / "v", "vllm")
    cfg, shapes, _ = read(out)
    assert cfg["num_hidden_layers"] == 1 and cfg["model_type"] == family
    assert cfg["architectures"] == [type(target).__name__]  # the engines add the Eagle prefix
    assert shapes["fc.weight"] == (H, 2 * H)
    assert "fc.bias" not in shapes
    assert all(k == "fc.weight" or k.startswith("layers.0.") for k in shapes)
    assert not any("input_layernorm" in k for k in shapes)  # dropped, as vLLM/SGLang expect
    assert shapes["layers.0.self_attn.q_proj.weight"] == (H, H)
    assert detect_layout(out) == "eagle1"
    back = import_head(out, target)
    assert torch.equal(outputs(back, target), outputs(head, target))
    saved_head("eagle1", target, tmp_path / "h2", input_layernorm=True)
    with pytest.raises(ValueError, match="input_layernorm"):
        export_head(tmp_path / "h2", tmp_path / "v2", "vllm")


def test_medusa_layout(tmp_path):
    target = make_target()
    head = saved_head("medusa1", target, tmp_path / "h", num_heads=3, num_layers=2)
    out = export_head(tmp_path / "h", tmp_path / "v", "vllm")
    cfg, shapes, _ = read(out)
    assert cfg["architectures"] == ["MedusaModel"] and cfg["model_type"] == "medusa"
    assert cfg["num_heads"] == 3 and cfg["num_hidden_layers"] == 2 and cfg["medusa_fc_bias"] is True
    assert cfg["hidden_size"] == H and cfg["vocab_size"] == V
    expected = {f"blocks.{h}.layers.{l}.{w}": (H, H) if w == "weight" else (H,)
                for h in range(3) for l in range(2) for w in ("weight", "bias")}
    expected.update({f"lm_heads.{h}.weight": (V, H) for h in range(3)})
    assert shapes == expected
    back = import_head(out, target)
    assert torch.equal(outputs(back, target), outputs(head, target))
    with pytest.raises(ValueError, match="SGLang has no Medusa"):
        export_head(tmp_path / "h", tmp_path / "s", "sglang")


def test_medusa_shared_lm_head_needs_the_target(tmp_path):
    target = make_target()
    head = saved_head("medusa1", target, tmp_path / "h", share_lm_head=True)
    with pytest.raises(ValueError, match="target_model"):
        export_head(tmp_path / "h", tmp_path / "v", "vllm")
    out = export_head(tmp_path / "h", tmp_path / "v", "vllm", target_model=target)
    cfg, shapes, _ = read(out)
    assert cfg["original_lm_head"] is True
    assert shapes["lm_heads.0.weight"] == (V, H) and "lm_heads.1.weight" not in shapes
    assert torch.equal(load_file(str(out / WEIGHTS_NAME))["lm_heads.0.weight"], target.lm_head.weight)
    back = import_head(out, target)
    assert back.config.share_lm_head
    assert torch.equal(outputs(back, target), outputs(head, target))


def test_ours_format_copies_and_loads(tmp_path):
    target = make_target()
    head = saved_head("eagle3", target, tmp_path / "h", draft_vocab_size=40)
    out = export_head(tmp_path / "h", tmp_path / "o", "ours", dtype=torch.bfloat16)
    assert detect_layout(out) == "ours"
    back = import_head(out, target)
    torch.testing.assert_close(outputs(back, target), outputs(head, target), atol=0.1, rtol=0.05)
    with pytest.raises(ValueError, match="unknown export format"):
        export_head(tmp_path / "h", tmp_path / "x", "onnx")


# ----------------------------------------------------------------------------- CLI


def test_cli_export(tmp_path, capsys):
    target = make_target()
    saved_head("eagle3", target, tmp_path / "h", draft_vocab_size=40)
    rc = cli_main(["export", str(tmp_path / "h"), "--format", "sglang", "--out", str(tmp_path / "s"), "--dtype", "bfloat16"])
    assert rc == 0
    assert json.loads((tmp_path / "s" / CONFIG_NAME).read_text())["torch_dtype"] == "bfloat16"
    saved_head("medusa1", target, tmp_path / "m")
    rc = cli_main(["export", str(tmp_path / "m"), "--format", "sglang", "--out", str(tmp_path / "ms")])
    assert rc == 2 and "SGLang has no Medusa" in capsys.readouterr().err
    rc = cli_main(["export", str(tmp_path / "missing"), "--format", "vllm", "--out", str(tmp_path / "x")])
    assert rc == 2 and "does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli_main(["export", str(tmp_path / "h"), "--format", "onnx", "--out", str(tmp_path / "x")])
