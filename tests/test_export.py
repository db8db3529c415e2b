"""Export to the engine layouts (keys, shapes, dtypes, config) and import back; foreign-layout
refusals. The layouts themselves are checked against the consumers' own code by `make interop`
and against checkpoints the upstream packages wrote (tests/test_interop_fixtures.py)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from drafthead.cli import main as cli_main
from drafthead.heads.io import HeadFormatError
from drafthead.ground.target.identity import HeadTargetMismatch
from drafthead.heads.registry import build_head, make_config
from drafthead.heads.formats import detect_layout, export_head, import_head
from drafthead.heads.io import CONFIG_NAME, WEIGHTS_NAME
from tests.tiny import tiny_causal_lm
from tests.head_checks import outputs

V, H, L = 128, 32, 4


def make_target(family="llama", **kw):
    return tiny_causal_lm(family, vocab=V, layers=L, hidden=H, **kw)


def saved_head(kind, target, path, **kw):
    if kind in ("eagle3", "eagle31"):
        kw.setdefault("aux_layers", (1, 2, 3))  # the engines' rule: 3 ascending ids below L
    cfg = make_config(kind, target, None, name="tiny", **kw)
    head = build_head(cfg, target, token_counts=(torch.arange(cfg.vocab_size) * 7919) % 101)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(0.05 * torch.randn_like(p))
    head.eval().save_pretrained(path)
    return head


def read(out, weights=WEIGHTS_NAME):
    cfg = json.loads((out / CONFIG_NAME).read_text())
    with safe_open(str(out / weights), "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}
    return cfg, shapes, dtypes


def strip_provenance(out):
    """Make our export look like another producer's: no `drafthead` block."""
    cfg = json.loads((out / CONFIG_NAME).read_text())
    del cfg["drafthead"]
    (out / CONFIG_NAME).write_text(json.dumps(cfg))
    return cfg


# ----------------------------------------------------------------------------- EAGLE-3


@pytest.mark.parametrize("fmt, ids", [("vllm", [1, 2, 3]), ("sglang", [0, 1, 2]), ("llama.cpp", [1, 2, 3])])
def test_eagle3_research_layouts(fmt, ids, tmp_path):
    target = make_target()
    head = saved_head("eagle3", target, tmp_path / "h", draft_vocab_size=40, aux_layers=(1, 2, 3))
    out = export_head(tmp_path / "h", tmp_path / fmt, fmt)
    cfg, shapes, dtypes = read(out)
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["model_type"] == "llama"
    assert cfg["num_hidden_layers"] == 1 and cfg["draft_vocab_size"] == 40 and cfg["vocab_size"] == V
    assert cfg["target_hidden_size"] == H and cfg["hidden_size"] == H
    # vLLM / llama.cpp count ids as output_hidden_states indices; SGLang adds 1 before capturing
    if fmt == "llama.cpp":  # its converter reads only the top-level key
        assert cfg["eagle_aux_hidden_state_layer_ids"] == ids and "eagle_config" not in cfg
    else:
        assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == ids
    assert cfg["num_attention_heads"] == 4 and cfg["num_key_value_heads"] == 2 and cfg["intermediate_size"] == 64
    assert cfg["rope_theta"] == target.config.rope_parameters["rope_theta"]
    assert cfg["attention_bias"] is False and cfg["torch_dtype"] == "float32"
    assert shapes["fc.weight"] == (H, 3 * H) and shapes["lm_head.weight"] == (40, H)
    assert shapes["d2t"] == (40,) and dtypes["d2t"] == "I64"
    assert shapes["t2d"] == (V,) and dtypes["t2d"] == "BOOL"
    assert shapes["midlayer.self_attn.q_proj.weight"] == (H, 2 * H)  # cat(embeds, hidden)
    expected = {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} | {f"midlayer.{k}" for k in head.midlayer.state_dict()}
    assert set(shapes) == expected
    d2t = load_file(str(out / WEIGHTS_NAME))["d2t"]
    assert torch.equal(d2t, head.d2t) and bool(d2t.any())  # not the all-zero bug
    back = import_head(out, target)  # our own export: the drafthead block says how ids are counted
    assert back.config.feature_layers == (1, 2, 3)
    assert torch.equal(outputs(back, target), outputs(head, target))


def test_foreign_eagle3_needs_its_id_convention(tmp_path):
    """Without our provenance block the ids are ambiguous: vLLM-side and SGLang-side producers
    count them differently, so the import refuses to guess."""
    target = make_target()
    head = saved_head("eagle3", target, tmp_path / "h", draft_vocab_size=40, aux_layers=(1, 2, 3))
    out = export_head(tmp_path / "h", tmp_path / "s", "sglang")
    strip_provenance(out)
    with pytest.raises(HeadFormatError, match="convention"):
        import_head(out, target)
    wrong = import_head(out, target, convention="vllm")
    assert wrong.config.feature_layers == (0, 1, 2)
    back = import_head(out, target, convention="sglang")
    assert back.config.feature_layers == (1, 2, 3)
    assert torch.equal(outputs(back, target), outputs(head, target))


def test_eagle3_qwen2_gets_zero_o_proj_bias_and_round_trips(tmp_path):
    """A head that keeps Qwen2's own layer (q/k/v biases, none on o_proj) exports as Llama's."""
    target = make_target("qwen2")
    head = saved_head("eagle3", target, tmp_path / "h", draft_vocab_size=40, draft_layer="target")
    out = export_head(tmp_path / "h", tmp_path / "v", "vllm")
    cfg, shapes, _ = read(out)
    assert cfg["attention_bias"] is True  # Llama's flag: bias on q/k/v *and* o_proj
    state = load_file(str(out / WEIGHTS_NAME))
    assert torch.equal(state["midlayer.self_attn.o_proj.bias"], torch.zeros(H))
    assert torch.equal(outputs(import_head(out, target), target), outputs(head, target))
    state["midlayer.self_attn.o_proj.bias"] += 1.0
    save_file(state, str(out / WEIGHTS_NAME))
    with pytest.raises(HeadFormatError, match="non-zero"):
        import_head(out, target)
    with pytest.raises(ValueError, match="attention biases"):
        export_head(tmp_path / "h", tmp_path / "l", "llama.cpp")


def test_speculators_layout(tmp_path):
    target = make_target()
    head = saved_head("eagle3", target, tmp_path / "h", draft_vocab_size=40, aux_layers=(1, 2, 3))
    with pytest.raises(ValueError, match="embed_tokens"):
        export_head(tmp_path / "h", tmp_path / "x", "speculators")
    out = export_head(tmp_path / "h", tmp_path / "s", "speculators", target_model=target)
    cfg, shapes, _ = read(out)
    assert cfg["speculators_model_type"] == "eagle3"
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    # every flag explicit: vLLM defaults norm_before_residual to True for this format
    assert cfg["norm_before_residual"] is False and cfg["norm_before_fc"] is False
    assert cfg["transformer_layer_config"]["vocab_size"] == V
    assert shapes["layers.0.self_attn.q_proj.weight"] == (H, 2 * H) and not any(k.startswith("midlayer") for k in shapes)
    assert torch.equal(load_file(str(out / WEIGHTS_NAME))["embed_tokens.weight"], target.model.embed_tokens.weight)
    strip_provenance(out)
    back = import_head(out, target)
    assert torch.equal(outputs(back, target), outputs(head, target))


def test_speculators_flags(tmp_path):
    """norm_before_residual changes the maths and the consumers default it differently
    (speculators False, vLLM True): absent, it is refused; stated, it is obeyed."""
    target = make_target()
    head = saved_head("eagle3", target, tmp_path / "h", draft_vocab_size=40, aux_layers=(1, 2, 3))
    out = export_head(tmp_path / "h", tmp_path / "s", "speculators", target_model=target)
    cfg = strip_provenance(out)
    del cfg["norm_before_residual"]
    (out / CONFIG_NAME).write_text(json.dumps(cfg))
    with pytest.raises(HeadFormatError, match="norm_before_residual"):
        import_head(out, target)
    cfg["norm_before_residual"] = True
    (out / CONFIG_NAME).write_text(json.dumps(cfg))
    back = import_head(out, target)
    assert back.config.norm_before_residual is True
    assert not torch.allclose(outputs(back, target), outputs(head, target))
    cfg["transformer_layer_config"]["layer_types"] = ["sliding_attention"]  # speculators' trainer default
    (out / CONFIG_NAME).write_text(json.dumps(cfg))
    with pytest.raises(HeadFormatError, match="no sliding_window"):
        import_head(out, target)
    cfg["transformer_layer_config"]["sliding_window"] = 2
    (out / CONFIG_NAME).write_text(json.dumps(cfg))
    windowed = import_head(out, target)
    assert windowed.config.sliding_window == 2
    assert not torch.allclose(outputs(windowed, target), outputs(back, target))  # 6 positions cross a window of 2
    with pytest.raises(ValueError, match="sliding window"):  # the research layout cannot say it
        windowed.save_pretrained(tmp_path / "w")
        export_head(tmp_path / "w", tmp_path / "wv", "vllm")
    del cfg["transformer_layer_config"]["sliding_window"]
    cfg["transformer_layer_config"]["layer_types"] = ["full_attention"]
    cfg["fc_norm"] = "yes"
    (out / CONFIG_NAME).write_text(json.dumps(cfg))
    with pytest.raises(HeadFormatError, match="fc_norm"):
        import_head(out, target)
    cfg["fc_norm"] = True  # EAGLE-3.1's per-feature norms: weights the file does not have
    (out / CONFIG_NAME).write_text(json.dumps(cfg))
    with pytest.raises(HeadFormatError, match="missing tensor.*fc_norm.0.weight"):
        import_head(out, target)


@pytest.mark.parametrize("flags", [{"norm_before_fc": True, "norm_output": True}, {"fc_norm": True}])
def test_eagle31_variants_round_trip_through_speculators(flags, tmp_path):
    target = make_target()
    head = saved_head("eagle3", target, tmp_path / "h", draft_vocab_size=40, aux_layers=(1, 2, 3), **flags)
    with pytest.raises(ValueError, match="speculators"):
        export_head(tmp_path / "h", tmp_path / "v", "sglang")
    vllm = export_head(tmp_path / "h", tmp_path / "v", "vllm")  # vLLM's research reader takes the flags too
    assert all(json.loads((vllm / CONFIG_NAME).read_text())[k] == v for k, v in flags.items())
    assert torch.equal(outputs(import_head(vllm, target), target), outputs(head, target))
    out = export_head(tmp_path / "h", tmp_path / "s", "speculators", target_model=target)
    strip_provenance(out)
    back = import_head(out, target)
    assert all(getattr(back.config, k) == v for k, v in flags.items())
    assert torch.equal(outputs(back, target), outputs(head, target))


def test_extra_embed_tokens_must_be_the_targets(tmp_path):
    target = make_target()
    saved_head("eagle3", target, tmp_path / "h", draft_vocab_size=40)
    out = export_head(tmp_path / "h", tmp_path / "s", "speculators", target_model=target)
    state = load_file(str(out / WEIGHTS_NAME))
    state["embed_tokens.weight"][5, 0] += 1.0
    save_file(state, str(out / WEIGHTS_NAME))
    with pytest.raises(HeadFormatError, match="embed_tokens.weight differs"):
        import_head(out, target)


def test_bf16_export(tmp_path):
    target = make_target()
    saved_head("eagle3", target, tmp_path / "h", draft_vocab_size=40)
    cfg, _, dtypes = read(export_head(tmp_path / "h", tmp_path / "v", "vllm", dtype=torch.bfloat16))
    assert cfg["torch_dtype"] == "bfloat16"
    assert dtypes.pop("d2t") == "I64" and dtypes.pop("t2d") == "BOOL"
    assert set(dtypes.values()) == {"BF16"}


def test_import_checks_target_identity_and_layer_fields(tmp_path):
    target = make_target()
    saved_head("eagle3", target, tmp_path / "h", draft_vocab_size=40)
    out = export_head(tmp_path / "h", tmp_path / "v", "vllm")
    with pytest.raises(HeadTargetMismatch, match="num_layers"):
        import_head(out, tiny_causal_lm("llama", vocab=V, layers=3, hidden=H))
    cfg = strip_provenance(out)
    cfg["rms_norm_eps"] = 1e-2  # changes the maths, not any shape
    (out / CONFIG_NAME).write_text(json.dumps(cfg))
    with pytest.raises(HeadFormatError, match="rms_norm_eps"):
        import_head(out, target, convention="vllm")


def test_unknown_tensor_is_named(tmp_path):
    target = make_target()
    saved_head("eagle3", target, tmp_path / "h", draft_vocab_size=40)
    out = export_head(tmp_path / "h", tmp_path / "v", "vllm")
    state = load_file(str(out / WEIGHTS_NAME))
    state["fc.bias"] = torch.zeros(H)
    save_file(state, str(out / WEIGHTS_NAME))
    with pytest.raises(HeadFormatError, match="unexpected tensor.*fc.bias"):
        import_head(out, target)


# ----------------------------------------------------------------------------- EAGLE-1


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_eagle1_engine_layout(family, tmp_path):
    target = make_target(family)
    head = saved_head("eagle1", target, tmp_path / "h")
    out = export_head(tmp_path / "h", tmp_path / "v", "vllm")
    cfg, shapes, _ = read(out)
    assert cfg["num_hidden_layers"] == 1 and cfg["model_type"] == "llama"  # the engines' layer, whatever the family
    assert cfg["architectures"] == ["LlamaForCausalLM"]  # vLLM adds the Eagle prefix
    assert shapes["fc.weight"] == (H, 2 * H) and "fc.bias" not in shapes
    assert all(k == "fc.weight" or k.startswith("layers.0.") for k in shapes)
    assert not any("input_layernorm" in k for k in shapes)  # dropped, as vLLM/SGLang expect
    assert detect_layout(out) == "eagle1"
    assert torch.equal(outputs(import_head(out, target), target), outputs(head, target))
    sg = export_head(tmp_path / "h", tmp_path / "s", "sglang")
    cfg, shapes, _ = read(sg)
    assert cfg["architectures"] == ["LlamaForCausalLMEagle"]  # SGLang adds no suffix itself
    assert torch.equal(load_file(str(sg / WEIGHTS_NAME))["fc.bias"], torch.zeros(H))  # its fc always has one
    assert torch.equal(outputs(import_head(sg, target), target), outputs(head, target))
    saved_head("eagle1", target, tmp_path / "h2", input_layernorm=True)
    with pytest.raises(ValueError, match="input_layernorm"):
        export_head(tmp_path / "h2", tmp_path / "v2", "vllm")
    saved_head("eagle1", target, tmp_path / "h3", fc_bias=True)  # random, non-zero bias
    with pytest.raises(ValueError, match="drops one silently"):
        export_head(tmp_path / "h3", tmp_path / "v3", "vllm")


def test_eagle1_family_layer_exports_where_an_engine_serves_it(tmp_path):
    """A head that keeps Qwen2's own layer: SGLang's Qwen2ForCausalLMEagle serves it, vLLM's EAGLE-1
    drafters have no Qwen2 layer, so that export refuses in one line."""
    target = make_target("qwen2")
    head = saved_head("eagle1", target, tmp_path / "h", draft_layer="target")
    with pytest.raises(ValueError, match="vllm's EAGLE-1 drafters are llama layers; this head keeps its qwen2"):
        export_head(tmp_path / "h", tmp_path / "v", "vllm")
    sg = export_head(tmp_path / "h", tmp_path / "s", "sglang")
    cfg, shapes, _ = read(sg)
    assert cfg["architectures"] == ["Qwen2ForCausalLMEagle"] and "layers.0.self_attn.q_proj.bias" in shapes
    assert torch.equal(outputs(import_head(sg, target), target), outputs(head, target))


def test_eagle1_upstream_layout(tmp_path):
    """Upstream EAGLE: pytorch_model.bin with embed_tokens and fc.bias, RoPE base 10000 always."""
    target = make_target(rope_theta=10000.0)
    head = saved_head("eagle1", target, tmp_path / "h")
    with pytest.raises(ValueError, match="embed_tokens"):
        export_head(tmp_path / "h", tmp_path / "x", "eagle")
    out = export_head(tmp_path / "h", tmp_path / "e", "eagle", target_model=target)
    assert not (out / WEIGHTS_NAME).exists()
    state = torch.load(out / "pytorch_model.bin", weights_only=True)
    assert torch.equal(state["fc.bias"], torch.zeros(H)) and torch.equal(state["embed_tokens.weight"], target.model.embed_tokens.weight)
    cfg = strip_provenance(out)
    assert cfg["bias"] is True and cfg["num_hidden_layers"] == 1
    back = import_head(out, target)
    assert back.config.fc_bias
    assert torch.equal(outputs(back, target), outputs(head, target))
    other = make_target(rope_theta=100000.0)
    saved_head("eagle1", other, tmp_path / "h5")
    with pytest.raises(ValueError, match="rope_theta"):
        export_head(tmp_path / "h5", tmp_path / "e5", "eagle", target_model=other)


def test_eagle1_stated_rope_needs_convention(tmp_path):
    """A config stating RoPE base 1e5: upstream EAGLE ran it at 10000, vLLM at 1e5."""
    target = make_target(rope_theta=100000.0)
    head = saved_head("eagle1", target, tmp_path / "h")
    out = export_head(tmp_path / "h", tmp_path / "v", "vllm")
    strip_provenance(out)
    with pytest.raises(HeadFormatError, match="convention"):
        import_head(out, target)
    vllm_side = import_head(out, target, convention="vllm")
    assert vllm_side.config.layer.rope_parameters is None  # the target's own
    assert torch.equal(outputs(vllm_side, target), outputs(head, target))
    upstream = import_head(out, target, convention="eagle")
    assert upstream.config.layer.rope_parameters["rope_theta"] == 10000.0
    assert not torch.allclose(outputs(upstream, target), outputs(head, target))


# ----------------------------------------------------------------------------- Medusa


@pytest.mark.parametrize("share", [False, True])
def test_medusa_upstream_layout(share, tmp_path):
    target = make_target()
    saved_head("medusa1", target, tmp_path / "h2", num_heads=3, num_layers=2, share_lm_head=share)
    with pytest.raises(ValueError, match="shares one residual block"):  # upstream repeats one block module
        export_head(tmp_path / "h2", tmp_path / "x2", "medusa", target_model=target)
    head = saved_head("medusa1", target, tmp_path / "h", num_heads=3, num_layers=1, share_lm_head=share)
    if share:
        with pytest.raises(ValueError, match="pass the target"):
            export_head(tmp_path / "h", tmp_path / "x", "medusa")
    out = export_head(tmp_path / "h", tmp_path / "m", "medusa", target_model=target)
    cfg = json.loads((out / CONFIG_NAME).read_text())
    assert cfg["medusa_num_heads"] == 3 and cfg["medusa_num_layers"] == 1
    state = torch.load(out / "medusa_lm_head.pt", weights_only=True)
    expected = {f"{h}.0.linear.{w}" for h in range(3) for w in ("weight", "bias")}
    assert set(state) == expected | {f"{h}.1.weight" for h in range(3)}
    assert detect_layout(out) == "medusa"
    back = import_head(out, target)
    assert torch.equal(outputs(back, target), outputs(head, target))
    with pytest.raises(ValueError, match="carries"):
        export_head(tmp_path / "h", tmp_path / "s", "sglang")


def test_medusa_unknown_key_refused(tmp_path):
    target = make_target()
    saved_head("medusa1", target, tmp_path / "h", num_heads=2)
    out = export_head(tmp_path / "h", tmp_path / "m", "medusa")
    state = torch.load(out / "medusa_lm_head.pt", weights_only=True)
    state["0.0.linear.scale"] = torch.ones(1)
    torch.save(state, out / "medusa_lm_head.pt")
    with pytest.raises(HeadFormatError, match="0.0.linear.scale"):
        import_head(out, target)
    (out / "medusa_lm_head.pt").write_bytes(b"not a zip")
    with pytest.raises(HeadFormatError, match="weights-only"):
        import_head(out, target)


# ----------------------------------------------------------------------------- ours, CLI


def test_ours_format_copies_and_loads(tmp_path):
    target = make_target()
    head = saved_head("eagle3", target, tmp_path / "h", draft_vocab_size=40)
    out = export_head(tmp_path / "h", tmp_path / "o", "ours", dtype=torch.bfloat16)
    assert detect_layout(out) == "ours"
    back = import_head(out, target)
    torch.testing.assert_close(outputs(back, target), outputs(head, target), atol=0.1, rtol=0.05)
    with pytest.raises(ValueError, match="unknown export format"):
        export_head(tmp_path / "h", tmp_path / "x", "onnx")


@pytest.mark.parametrize("aux, why", [((2, 2, 1), "ascending"), ((1, 2, 4), "normed"), ((1, 2), "exactly 3")])
def test_engine_exports_refuse_layers_the_engines_read_differently(aux, why, tmp_path):
    target = make_target()
    saved_head("eagle3", target, tmp_path / "h", draft_vocab_size=40, aux_layers=aux)
    for fmt in ("vllm", "sglang", "llama.cpp"):
        with pytest.raises(ValueError, match=why):
            export_head(tmp_path / "h", tmp_path / fmt, fmt)


def test_cli_export_and_import(tmp_path, capsys, tiny_target_dir):
    from drafthead.ground.target.load import load_target

    tiny_llama_dir = tiny_target_dir("llama", layers=L)
    loaded = load_target(tiny_llama_dir)
    target = loaded.model
    head = saved_head("eagle3", target, tmp_path / "h", draft_vocab_size=40, aux_layers=(1, 2, 3))
    rc = cli_main(["export", str(tmp_path / "h"), "--format", "sglang", "--out", str(tmp_path / "s"), "--dtype", "bfloat16"])
    assert rc == 0
    assert json.loads((tmp_path / "s" / CONFIG_NAME).read_text())["torch_dtype"] == "bfloat16"
    strip_provenance(tmp_path / "s")
    args = ["import", str(tmp_path / "s"), "--target", str(tiny_llama_dir), "--out", str(tmp_path / "i")]
    assert cli_main(args) == 2 and "convention" in capsys.readouterr().err
    assert cli_main(args + ["--convention", "sglang"]) == 0 and "eagle3-research" in capsys.readouterr().err
    assert detect_layout(tmp_path / "i") == "ours"
    back = import_head(tmp_path / "i", target, loaded.tokenizer)
    assert back.config.feature_layers == head.config.feature_layers
    assert load_file(str(tmp_path / "i" / WEIGHTS_NAME))["fc.weight"].dtype == torch.bfloat16  # stored dtype kept
    saved_head("medusa1", target, tmp_path / "m")
    rc = cli_main(["export", str(tmp_path / "m"), "--format", "sglang", "--out", str(tmp_path / "ms")])
    assert rc == 2 and "carries" in capsys.readouterr().err
    rc = cli_main(["export", str(tmp_path / "missing"), "--format", "vllm", "--out", str(tmp_path / "x")])
    assert rc == 2 and "does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli_main(["export", str(tmp_path / "h"), "--format", "onnx", "--out", str(tmp_path / "x")])


def test_head_option_reads_a_foreign_layout(tmp_path, tiny_target_dir, capsys):
    """--head accepts a published layout: read exactly, said so, and greedy output stays the target's."""
    from drafthead import GenerationConfig, speculative_generate
    from drafthead.draft_spec import DraftSpec
    from drafthead.ground.target.load import load_target
    from tests.tiny import plain_greedy, repetitive_prompt

    loaded = load_target(tiny_target_dir("llama", layers=L))
    saved_head("eagle3", loaded.model, tmp_path / "h", draft_vocab_size=40)
    out = export_head(tmp_path / "h", tmp_path / "s", "speculators", target_model=loaded.model)
    strip_provenance(out)
    drafting = DraftSpec(head=str(out), lookup_nodes=0).build(loaded, note=lambda line: None)
    drafter, target = drafting.factory(), drafting.model
    assert "is a speculators checkpoint" in capsys.readouterr().err
    prompt = repetitive_prompt(len(loaded.tokenizer))
    result = speculative_generate(target, drafter, prompt, GenerationConfig(max_new_tokens=16, eos_token_ids=()))
    assert result.new_tokens[0].tolist() == plain_greedy(target, prompt, 16)
    research = export_head(tmp_path / "h", tmp_path / "v", "vllm")
    strip_provenance(research)
    with pytest.raises(HeadFormatError, match="drafthead import"):
        DraftSpec(head=str(research)).build(loaded, note=lambda line: None)


def test_eagle31_kind_exports_where_the_flags_are_read(tmp_path):
    target = make_target()
    head = saved_head("eagle31", target, tmp_path / "h", draft_vocab_size=40)
    assert head.config.fc_norm and head.config.norm_output and head.fc_norm is not None
    for fmt in ("sglang", "llama.cpp"):
        with pytest.raises(ValueError):
            export_head(tmp_path / "h", tmp_path / fmt, fmt)
    for fmt in ("vllm", "speculators"):
        out = export_head(tmp_path / "h", tmp_path / fmt, fmt, target_model=target)
        cfg = json.loads((out / CONFIG_NAME).read_text())
        assert cfg["fc_norm"] is True and cfg["norm_output"] is True
        assert torch.equal(outputs(import_head(out, target), target), outputs(head, target))


@pytest.mark.parametrize("fmt", ["vllm", "speculators", "sglang"])
def test_a_full_draft_vocabulary_exports_without_its_identity_maps(fmt, tmp_path):
    """With Vd == V the engines build no d2t / t2d (vLLM refuses them as unknown parameters): the
    export leaves them out and the import restores the identity."""
    target = make_target()
    head = saved_head("eagle3", target, tmp_path / "h", draft_vocab_size=V)
    out = export_head(tmp_path / "h", tmp_path / fmt, fmt, target_model=target)
    _, shapes, _ = read(out)
    assert "d2t" not in shapes and "t2d" not in shapes and shapes["lm_head.weight"] == (V, H)
    back = import_head(out, target, convention="vllm" if fmt == "vllm" else None)
    assert torch.equal(back.d2t, torch.zeros(V, dtype=torch.long)) and bool(back.t2d.all())
    assert torch.allclose(outputs(back, target), outputs(head, target))


# ----------------------------------------------------------------------------- values, not shapes

# Every (kind, format) an export writes that a layout reads back; the MTP export alone has no
# reader (a target's own MTP layer is imported from the target, heads/mtp.py)
READABLE_EXPORTS = [
    ("eagle1", "vllm"),
    ("eagle1", "sglang"),
    ("eagle1", "eagle"),
    ("eagle3", "vllm"),
    ("eagle3", "sglang"),
    ("eagle3", "llama.cpp"),
    ("eagle3", "speculators"),
    ("eagle31", "vllm"),
    ("eagle31", "speculators"),
    ("peagle", "speculators"),
    ("medusa1", "medusa"),
    ("dflash", "dflash"),
    ("dspark", "dspark"),
    ("dspark", "speculators"),
]
ROUND_TRIP_SETTINGS = {
    "eagle3": {"draft_vocab_size": 40},
    "eagle31": {"draft_vocab_size": 40},
    "peagle": {"draft_vocab_size": 40, "aux_layers": (1, 2, 3), "mask_token_id": 5},
    "medusa1": {"num_heads": 2},
    "dflash": {"mask_token_id": 5, "block_size": 4},
    "dspark": {"mask_token_id": 5, "block_size": 4, "markov_rank": 8},
}


def test_every_export_with_a_reader_is_round_tripped_by_value():
    from drafthead.heads.formats import _EXPORTS

    written = {(kind, e.format) for e in _EXPORTS for kind in e.kinds}
    assert written - set(READABLE_EXPORTS) == {("mtp", "mtp")}


@pytest.mark.parametrize("kind, fmt", READABLE_EXPORTS)
def test_export_round_trips_every_tensor_by_value_on_an_mha_target(kind, fmt, tmp_path):
    """An MHA target (as many KV heads as query heads): the draft layer's q_proj and k_proj have
    one shape, so a layout that swaps them (or any two tensors of one shape) still loads; only the
    values show it. Every tensor the head holds must come back equal."""
    target = make_target(num_key_value_heads=4, rope_theta=10000.0)  # upstream EAGLE runs RoPE at 10000
    assert target.config.num_key_value_heads == target.config.num_attention_heads
    head = saved_head(kind, target, tmp_path / "h", **ROUND_TRIP_SETTINGS.get(kind, {}))
    out = export_head(tmp_path / "h", tmp_path / "out", fmt, target_model=target)
    back = import_head(out, target)
    mine, theirs = head.state_dict(), back.state_dict()
    assert set(theirs) == set(mine)
    for name, tensor in mine.items():
        assert torch.equal(theirs[name], tensor), name
    attention = [n for n in mine if n.endswith(("q_proj.weight", "k_proj.weight"))]
    assert all(mine[n].shape == mine[attention[0]].shape for n in attention) and (attention or kind == "medusa1")
