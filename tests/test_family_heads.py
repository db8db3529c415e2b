"""Every head kind on every target family (tests/tiny.py FAMILIES): it trains with finite loss,
drafts exactly, and each export format that carries it writes the tensors its consumer's loader
maps, no more, no fewer, or refuses in one line naming the consumer and why. Gemma's embedding
scale included: heads embed with the raw table, as every consumer's drafter does.

The draft layer is Llama's, sized from the target, whatever the family (docs/formats.md "The draft
layer per target family"). Key sets are those of the checkpoints the producers' own code wrote
(tests/fixtures/interop, scripts/interop/fixtures_*.py); shapes are those a Llama (Qwen3 for
DFlash) layer built from the export's own config holds, which is what the consumers build.
Exactness of P-EAGLE and DFlash on every family: tests/test_peagle.py, tests/test_dflash.py.
"""
from __future__ import annotations

import functools
import json
import math

import pytest
import torch
from safetensors import safe_open
from transformers import LlamaConfig, Qwen3Config
from transformers.models.llama.modeling_llama import LlamaDecoderLayer
from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer

from drafthead.heads.formats import _FORMAT_KINDS, ENGINES, export_head
from drafthead.heads.formats.common import read_weights
from drafthead.heads.io import CONFIG_NAME, WEIGHTS_NAME
from drafthead.heads.registry import build_head, make_config
from drafthead.inference.drafters.heads import EagleDrafter
from drafthead.train.features import CapturedFeatures, OnlineFeaturizer, capture_features, collate
from tests.test_head_drafters import assert_greedy_equals_plain
from tests.test_interop_fixtures import ROOT
from tests.tiny import TARGETS, tiny_causal_lm

V = 96
KINDS = {
    "eagle1": {},
    # aux_layers: the engines' rule, 3 ascending ids below L (the default clamps to (2, 2, 1) at L = 4)
    "eagle3": {"draft_vocab_size": 64, "ttt_steps": 2, "aux_layers": (1, 2, 3)},
    "eagle31": {"draft_vocab_size": 64, "ttt_steps": 2, "aux_layers": (1, 2, 3)},
    "peagle": {"draft_vocab_size": 64, "parallel_depth": 3, "mask_token_id": V - 1, "aux_layers": (1, 2, 3)},
    "dflash": {"block_size": 4, "mask_token_id": V - 1, "num_anchors": 4},
}
CAPTURED_FAMILIES = ("qwen3_moe", "gpt_oss", "gemma3")  # online features train every family


@functools.cache
def target_of(family: str):
    return tiny_causal_lm(family, vocab=V, layers=4, hidden=32, attn="eager" if family == "gpt_oss" else "sdpa")


def head_of(family: str, kind: str, seed: int = 0):
    target = target_of(family)
    torch.manual_seed(seed)
    config = make_config(kind, target, None, name=f"tiny-{family}", **KINDS[kind])
    return build_head(config, target, token_counts=torch.arange(V), dtype=torch.float32)


def samples(n: int = 4, length: int = 20, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(3, V, (length,), generator=g)
        loss_mask = torch.arange(length) >= length // 3  # a "prompt" third, then labels
        out.append({"input_ids": ids, "loss_mask": loss_mask})
    return out


def train_losses(head, batch, steps: int = 3) -> list[float]:
    head.train()
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(steps):
        loss, _ = head.compute_loss(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    head.eval()
    return losses


# ----------------------------------------------------------------------------- training


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("family", TARGETS)
def test_trains_with_finite_loss_on_online_features(family, kind):
    head = head_of(family, kind)
    batch = OnlineFeaturizer(target_of(family), head.config.train_hidden_layers)(collate(samples()))
    losses = train_losses(head, batch)
    assert all(math.isfinite(x) for x in losses), losses
    assert all(math.isfinite(p.detach().abs().max().item()) for p in head.parameters())


@pytest.mark.parametrize("family", CAPTURED_FAMILIES)
def test_trains_with_finite_loss_on_captured_features(family, tmp_path):
    head = head_of(family, "eagle3")
    capture_features(target_of(family), samples(), head.config.train_hidden_layers, tmp_path / "cap", batch_size=2)
    captured = CapturedFeatures(tmp_path / "cap")
    batch = collate([captured[i] for i in range(len(captured))])
    online = OnlineFeaturizer(target_of(family), head.config.train_hidden_layers)(collate(samples()))
    for layer, h in online.hidden_states.items():  # the cache holds what the target computes online
        torch.testing.assert_close(batch.hidden_states[layer], h)
    assert all(math.isfinite(x) for x in train_losses(head, batch))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_qwen3_moe_eagle3_loss_is_finite_over_seeds(seed):
    """The MoE target once gave a NaN loss at step 1 in two runs of three (its MoE draft layer)."""
    head = head_of("qwen3_moe", "eagle3", seed=seed)
    batch = OnlineFeaturizer(target_of("qwen3_moe"), head.config.train_hidden_layers)(collate(samples(seed=seed)))
    assert all(math.isfinite(x) for x in train_losses(head, batch, steps=5))
    assert not any(".experts." in k or ".gate." in k for k in head.state_dict())  # a dense Llama MLP


# ----------------------------------------------------------------------------- exactness


@pytest.mark.parametrize("kind", ["eagle1", "eagle3", "eagle31"])
@pytest.mark.parametrize("family", TARGETS)
def test_greedy_equals_plain_at_batch_1_and_ragged_3(family, kind):
    head = head_of(family, kind).eval()
    assert_greedy_equals_plain(target_of(family),
                               lambda num_draft=8: EagleDrafter(head, num_draft=num_draft, depth=3, top_k=2),
                               max_new_tokens=12, trees=(None,))


# ----------------------------------------------------------------------------- exports


def fixture_keys(name: str, drop=()) -> set[str]:
    """The tensor names a producer's own code wrote for this layout (tests/fixtures/interop)."""
    return set(read_weights(ROOT / name)) - set(drop)


# export format -> the producer's checkpoint of that layout, less tensors our export leaves to the
# target (vLLM's and SGLang's EAGLE-1 read the target's embedding; SGLang's fc carries a bias)
CONSUMER_KEYS = {
    ("eagle1", "vllm"): lambda: fixture_keys("eagle1", ("embed_tokens.weight", "fc.bias")),
    ("eagle1", "sglang"): lambda: fixture_keys("eagle1", ("embed_tokens.weight",)),
    ("eagle1", "eagle"): lambda: fixture_keys("eagle1"),
    ("eagle3", "vllm"): lambda: fixture_keys("specforge-sglang"),
    ("eagle3", "sglang"): lambda: fixture_keys("specforge-sglang"),
    ("eagle3", "llama.cpp"): lambda: fixture_keys("llamacpp-eagle3"),
    ("eagle3", "speculators"): lambda: fixture_keys("speculators-eagle3"),
    ("dflash", "dflash"): lambda: fixture_keys("dflash"),
}
# tensors of flags no producer fixture sets (EAGLE-3.1's per-feature norms, P-EAGLE's mask
# stand-ins): named by the layouts' docs (docs/formats.md), added to the base key set
FLAG_KEYS = {"eagle31": {"fc_norm.0.weight", "fc_norm.1.weight", "fc_norm.2.weight"}, "peagle": {"mask_hidden"}}


def export_formats(kind: str) -> list[str]:
    return [fmt for fmt, kinds in _FORMAT_KINDS.items() if kind in kinds]


def written(out) -> tuple[dict, dict[str, tuple[int, ...]]]:
    cfg = json.loads((out / CONFIG_NAME).read_text())
    weights = out / WEIGHTS_NAME if (out / WEIGHTS_NAME).exists() else out / "pytorch_model.bin"
    if weights.suffix == ".bin":
        return cfg, {k: tuple(v.shape) for k, v in torch.load(weights, weights_only=True).items()}
    with safe_open(str(weights), "pt") as f:
        return cfg, {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}


def consumer_layer_shapes(kind: str, fmt: str, cfg: dict) -> tuple[str, dict[str, tuple[int, ...]]]:
    """(key prefix, {name: shape}) of the decoder layer the consumer builds from the export's config."""
    if kind == "dflash":
        fields = {k: v for k, v in cfg.items() if k in Qwen3Config().to_dict()}
        return "layers.0.", {k: tuple(v.shape) for k, v in Qwen3DecoderLayer(Qwen3Config(**fields), 0).state_dict().items()}
    layer_cfg = cfg["transformer_layer_config"] if fmt == "speculators" else cfg
    fields = {k: v for k, v in layer_cfg.items() if k in LlamaConfig().to_dict() and k not in ("architectures", "model_type")}
    shapes = {k: tuple(v.shape) for k, v in LlamaDecoderLayer(LlamaConfig(**fields), 0).state_dict().items()}
    if kind == "eagle1":
        return "layers.0.", shapes
    H = layer_cfg["hidden_size"]
    for name in ("q_proj", "k_proj", "v_proj"):  # EAGLE-3's attention reads cat(embedding, feature)
        shapes[f"self_attn.{name}.weight"] = (shapes[f"self_attn.{name}.weight"][0], 2 * H)
    shapes["hidden_norm.weight"] = (H,)
    return ("layers.0." if fmt == "speculators" else "midlayer."), shapes


def expected_refusal(target, fmt: str) -> str | None:
    """What the export to `fmt` must refuse for, from the target's own config: upstream EAGLE's
    fixed RoPE (base 10000, whatever the config says)."""
    rope = target.config.get_text_config().rope_parameters  # a multimodal target's is its language model's
    rope = rope.get("full_attention", rope)  # Gemma 3: one RoPE per layer type
    if fmt == "eagle" and (rope.get("rope_type") != "default" or rope.get("rope_theta") != 10000.0):
        return "RoPE with base 10000"
    return None


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("family", TARGETS)
def test_exports_write_what_the_consumer_loads_or_refuse_in_one_line(family, kind, tmp_path):
    head = head_of(family, kind)
    head.save_pretrained(tmp_path / "head")
    target = target_of(family)
    for fmt in export_formats(kind):
        out = tmp_path / fmt
        why = expected_refusal(target, fmt)
        if why is not None:
            with pytest.raises(ValueError) as refused:
                export_head(tmp_path / "head", out, fmt, target_model=target)
            message = str(refused.value)
            assert "\n" not in message and message.startswith(ENGINES[fmt]) and why in message, message
            continue
        export_head(tmp_path / "head", out, fmt, target_model=target)
        cfg, shapes = written(out)
        base = "eagle3" if kind in ("eagle31", "peagle") else kind
        expected = CONSUMER_KEYS[(base, fmt)]() | FLAG_KEYS.get(kind, set())
        assert set(shapes) == expected, f"{fmt}: unexpected {sorted(set(shapes) - expected)}, missing {sorted(expected - set(shapes))}"
        prefix, layer = consumer_layer_shapes(kind, fmt, cfg)
        if kind == "eagle1":
            layer.pop("input_layernorm.weight")  # EAGLE-1 checkpoints drop it (the fixture has none)
        ours = {k[len(prefix):]: v for k, v in shapes.items() if k.startswith(prefix)}
        assert ours == layer, f"{fmt}: layer shapes differ from the consumer's layer built from the export's config"


# ----------------------------------------------------------------------------- heads saved before


def test_a_head_saved_with_its_family_layer_loads_drafts_and_refuses_export(tmp_path):
    """A Qwen3 head saved before `draft_layer` existed (its config has no such key) holds Qwen3's
    own layer with q/k norms: it loads as that layer and drafts exactly; speculators serves it
    (its Qwen3 EAGLE-3 layer) and it imports back, on a Qwen3 target only; every other engine
    export refuses in one line naming the engine."""
    from drafthead.heads.registry import load_head

    target = target_of("qwen3")
    config = make_config("eagle3", target, None, name="tiny-qwen3", **KINDS["eagle3"], draft_layer="target")
    folder = build_head(config, target, token_counts=torch.arange(V)).save_pretrained(tmp_path / "old")
    meta = json.loads((folder / CONFIG_NAME).read_text())
    del meta["config"]["draft_layer"]
    (folder / CONFIG_NAME).write_text(json.dumps(meta))
    head, _ = load_head(folder, target, None, target_name="tiny-qwen3")
    assert head.config.draft_layer == "target" and "midlayer.self_attn.q_norm.weight" in head.state_dict()
    assert_greedy_equals_plain(target, lambda num_draft=8: EagleDrafter(head, num_draft=num_draft, depth=3, top_k=2),
                               max_new_tokens=12, trees=(None,))
    from drafthead.heads.formats import import_head
    from drafthead.heads.io import HeadFormatError
    from tests.test_export import outputs

    for fmt in export_formats("eagle3"):
        if fmt == "speculators":
            continue
        with pytest.raises(ValueError) as refused:
            export_head(folder, tmp_path / fmt, fmt)
        message = str(refused.value)
        assert "\n" not in message and message.startswith(f"{ENGINES[fmt]} serves a Llama draft layer") and "qwen3" in message
    out = export_head(folder, tmp_path / "speculators", "speculators", target_model=target)
    cfg, shapes = written(out)
    assert cfg["transformer_layer_config"]["model_type"] == "qwen3" and "layers.0.self_attn.q_norm.weight" in shapes
    strip_provenance(out)
    back = import_head(out, target)
    assert back.config.draft_layer == "target" and torch.equal(outputs(back, target), outputs(head, target))
    with pytest.raises(HeadFormatError, match="the checkpoint's draft layer is qwen3's"):
        import_head(out, target_of("llama"))


# ----------------------------------------------------------------------------- imports


def strip_provenance(out) -> dict:
    """Make an export look like its producer's own: no `drafthead` block. Returns the config."""
    cfg = json.loads((out / CONFIG_NAME).read_text())
    del cfg["drafthead"]
    (out / CONFIG_NAME).write_text(json.dumps(cfg))
    return cfg


@pytest.mark.parametrize("family", ["qwen3", "gpt_oss"])
def test_speculators_eagle3_of_a_qwen3_or_gpt_oss_verifier_imports(family, tmp_path):
    """speculators' layout for these verifiers: a Llama transformer_layer_config sized from the
    verifier (its head_dim field included), the verifier's architecture named."""
    from drafthead.heads.formats import import_head
    from tests.test_export import outputs

    head = head_of(family, "eagle3").eval()
    head.save_pretrained(tmp_path / "head")
    out = export_head(tmp_path / "head", tmp_path / "s", "speculators", target_model=target_of(family))
    cfg = strip_provenance(out)
    assert cfg["speculators_config"]["verifier"]["architectures"] == [type(target_of(family)).__name__]
    assert cfg["transformer_layer_config"]["model_type"] == "llama" and cfg["transformer_layer_config"]["head_dim"] == 8
    back = import_head(out, target_of(family))
    assert back.config.draft_layer == "llama" and back.config.feature_layers == (1, 2, 3)
    assert torch.equal(outputs(back, target_of(family)), outputs(head, target_of(family)))


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_exports_for_an_mrope_target_state_the_plain_rope_its_head_drafts_with(family, tmp_path):
    """A head drafts with one position per token, prefix + depth (the target's mrope_section is
    dropped from the draft layer's RoPE, heads/eagle.py `full_attention_rope`); for text that is
    each of the target's three M-RoPE rows. The exports state no mrope_section: vLLM then runs the
    draft with a plain RoPE over the first row of the target's positions, where with one it would
    build M-RoPE for the draft and refuse P-EAGLE (docs/formats.md "M-RoPE targets"). speculators
    writes its verifier's mrope_section into its Qwen3-VL drafts, which it trains on plain
    positions: such a config imports and drafts as the plain one."""
    from drafthead.heads.formats import import_head
    from tests.test_export import outputs

    target = target_of(family)
    assert "mrope_section" in target.config.get_text_config().rope_parameters
    for kind, fmt in (("eagle3", "vllm"), ("eagle3", "speculators"), ("peagle", "speculators")):
        head_of(family, kind).save_pretrained(tmp_path / kind)
        out = export_head(tmp_path / kind, tmp_path / f"{kind}-{fmt}", fmt, target_model=target)
        assert "mrope" not in (out / CONFIG_NAME).read_text(), (kind, fmt)
    # vLLM's registry maps Eagle3Qwen2_5vlForCausalLM and Eagle3Qwen3vlForCausalLM to this name's class
    assert json.loads((tmp_path / "eagle3-vllm" / CONFIG_NAME).read_text())["architectures"] == ["LlamaForCausalLMEagle3"]
    cfg = strip_provenance(tmp_path / "eagle3-speculators")
    assert cfg["speculators_config"]["verifier"]["architectures"] == [type(target).__name__]
    layer = cfg["transformer_layer_config"]
    layer["rope_parameters"] = {"rope_type": "default", "rope_theta": layer["rope_theta"], "mrope_section": [2, 1, 1]}
    (tmp_path / "eagle3-speculators" / CONFIG_NAME).write_text(json.dumps(cfg))
    head = head_of(family, "eagle3").eval()
    assert torch.equal(outputs(import_head(tmp_path / "eagle3-speculators", target), target), outputs(head, target))


@pytest.mark.parametrize("family,fmt,own", [
    # SpecForge's MoE configs pick their own MLP width (12288 for Qwen3-30B-A3B, whose config says 6144)
    ("qwen3_moe", "vllm", {"intermediate_size": 48}),
    # speculators' trainer gives the draft its verifier's activation (Gemma 3: GELU-tanh)
    ("gemma3", "speculators", {"hidden_act": "gelu_pytorch_tanh"}),
    # SpecForge's DeepSeek-V3 config states no head_dim: hidden / heads, not the MLA target's field
    ("deepseek_v3", "sglang", {"head_dim": 8}),
])
def test_a_producers_own_draft_layer_fields_are_kept_on_import(family, fmt, own, tmp_path):
    from drafthead.heads.formats import import_head
    from tests.test_export import outputs

    target = target_of(family)
    config = make_config("eagle3", target, None, name=f"tiny-{family}", **KINDS["eagle3"], **own)
    head = build_head(config, target, token_counts=torch.arange(V)).eval()
    head.save_pretrained(tmp_path / "head")
    out = export_head(tmp_path / "head", tmp_path / fmt, fmt, target_model=target)
    cfg = strip_provenance(out)
    stated = cfg["transformer_layer_config"] if fmt == "speculators" else cfg
    assert {k: stated[k] for k in own} == own
    if family == "deepseek_v3":
        del cfg["head_dim"]
        (out / CONFIG_NAME).write_text(json.dumps(cfg))
    back = import_head(out, target, convention={"speculators": None}.get(fmt, fmt))
    assert {k: getattr(back.config, k) for k in own} == own
    assert torch.equal(outputs(back, target), outputs(head, target))
    if "hidden_act" in own:  # vLLM's and SGLang's Llama MLP refuse anything but SiLU at load
        with pytest.raises(ValueError, match="^vLLM's Llama draft MLP runs SiLU only"):
            export_head(tmp_path / "head", tmp_path / "vllm", "vllm")


def test_specforge_to_hf_without_ids_reads_the_engines_default_capture_points(tmp_path):
    """SpecForge's `to_hf` writes no eagle_config unless its draft config had one: the engines then
    capture the inputs of layers [2, L//2, L-3], our default, and the import says so."""
    import shutil

    from drafthead.heads.config import default_eagle3_layers
    from drafthead.heads.formats import import_to_folder
    from drafthead.heads.registry import load_head
    from transformers import AutoModelForCausalLM

    from tests.interop import target_as_producer_saw

    folder = shutil.copytree(ROOT / "specforge-hf", tmp_path / "hf")
    cfg = json.loads((folder / CONFIG_NAME).read_text())
    del cfg["eagle_config"]
    (folder / CONFIG_NAME).write_text(json.dumps(cfg))
    fixture_target = target_as_producer_saw(AutoModelForCausalLM.from_pretrained(ROOT / "target", dtype=torch.float32), folder)
    out, notes = import_to_folder(folder, tmp_path / "ours", fixture_target)
    assert any("names no eagle_aux_hidden_state_layer_ids: read with the engines' default capture points" in n
               for n in notes), notes
    head, _ = load_head(out, fixture_target, None)
    assert head.config.feature_layers == default_eagle3_layers(fixture_target.config.num_hidden_layers)


def test_heads_embed_with_the_raw_table_as_the_engines_do():
    """Gemma's embedding module scales the table by sqrt(hidden); the engines' drafters look rows
    up in the table alone, and so do our heads (their exports then draft the same)."""
    target = target_of("gemma3")
    ids = torch.tensor([[3, 17, 95]])
    head = head_of("gemma3", "eagle3")
    table = target.get_input_embeddings().weight[ids]
    assert torch.equal(head.refs.embed_tokens(ids, torch.float32), table)
    assert not torch.allclose(target.get_input_embeddings()(ids), table)  # the module does scale
