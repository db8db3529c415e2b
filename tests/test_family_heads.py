"""Every head kind on every target family (tests/tiny.py FAMILIES): it trains with finite loss,
drafts exactly, and each export format that carries it writes the tensors its consumer's loader
maps, no more, no fewer, or refuses in one line naming the consumer and why. Gemma's embedding
scale included: heads embed with the raw table, as every consumer's drafter does.

The draft layer is Llama's, sized from the target, whatever the family (docs/formats.md "The draft
layer per target family"). Each export's tensor names and shapes are those of the model its
consumer builds from the export's own config (`consumer_shapes`, which gives exactly the names and
shapes of every consumer-written fixture from that fixture's config). Where the consumer's own code
writes the layout (speculators, upstream EAGLE and Medusa, z-lab's DFlash, SpecForge for SGLang),
the export also holds that checkpoint's tensor names and config keys (tests/fixtures/interop,
scripts/interop/fixtures_*.py). vLLM and llama.cpp only read: their exports are loaded by their
own code instead (READ_ONLY).
Exactness of P-EAGLE and DFlash on every family: tests/test_peagle.py, tests/test_dflash.py.
"""

from __future__ import annotations

import functools
import json
import math

import pytest
import torch
from safetensors import safe_open
from transformers import LlamaConfig, PretrainedConfig, Qwen3Config
from transformers.models.llama.modeling_llama import LlamaDecoderLayer
from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer

from drafthead.inference.drafters.settings import TreeSettings
from drafthead.heads.formats import consumer, export_head, formats_for
from drafthead.heads.io import CONFIG_NAME, WEIGHTS_NAME
from drafthead.heads.registry import build_head, make_config
from drafthead.inference.drafters.head_drafters import EagleDrafter
from drafthead.train.capture.features import CapturedFeatures, OnlineFeaturizer, capture_features, collate
from tests.head_checks import assert_greedy_equals_plain
from tests.interop import FIXTURES as ROOT
from tests.tiny import HYBRID_TARGETS, NOPE_HYBRIDS, TARGETS, tiny_causal_lm

V = 96
KINDS = {
    "eagle1": {},
    # aux_layers: the engines' rule, 3 ascending ids below L (the default clamps to (2, 2, 1) at L = 4)
    "eagle3": {"draft_vocab_size": 64, "ttt_steps": 2, "aux_layers": (1, 2, 3)},
    "eagle31": {"draft_vocab_size": 64, "ttt_steps": 2, "aux_layers": (1, 2, 3)},
    "peagle": {"draft_vocab_size": 64, "parallel_depth": 3, "mask_token_id": V - 1, "aux_layers": (1, 2, 3)},
    "dflash": {"block_size": 4, "mask_token_id": V - 1, "num_anchors": 4},
    "dspark": {"block_size": 4, "mask_token_id": V - 1, "num_anchors": 4, "markov_rank": 8},
}
# kinds only the export test builds here (their training and decoding: tests/test_families.py);
# Medusa-1 as the medusa fixture has it, 3 heads of one block
EXPORT_KINDS = {"medusa1": {"num_heads": 3, "num_layers": 1}}
CAPTURED_FAMILIES = ("qwen3_moe", "gpt_oss", "gemma3")  # online features train every family


@functools.cache
def target_of(family: str):
    return tiny_causal_lm(family, vocab=V, layers=4, hidden=32, attn="eager" if family == "gpt_oss" else "sdpa")


def head_of(family: str, kind: str, seed: int = 0):
    target = target_of(family)
    torch.manual_seed(seed)
    config = make_config(kind, target, None, name=f"tiny-{family}", **{**KINDS, **EXPORT_KINDS}[kind])
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
    assert_greedy_equals_plain(
        target_of(family),
        lambda num_draft=8: EagleDrafter(head, TreeSettings(num_draft=num_draft, depth=3, branch=2)),
        max_new_tokens=12,
        trees=(None,),
    )


# ----------------------------------------------------------------------------- exports


def fixture_keys(name: str) -> set[str]:
    """The tensor names a producer's own code wrote for this layout (tests/fixtures/interop)."""
    return set(written(ROOT / name)[1])


# (kind, format) -> the checkpoint that the consumer's own code, or the trainer written for it,
# wrote in that layout (its name under tests/fixtures/interop)
WRITTEN_BY_CONSUMER = {
    ("eagle1", "eagle"): "eagle1",  # eagle-llm's own training save
    ("eagle3", "sglang"): "specforge-sglang",  # SpecForge's export_to_sglang, SGLang's trainer
    ("eagle3", "speculators"): "speculators-eagle3",  # speculators' save_pretrained
    ("dflash", "dflash"): "dflash",  # z-lab's DFlashDraftModel.save_pretrained
    ("dspark", "speculators"): "speculators-dspark",  # speculators' DSparkDraftModel.save_pretrained
    ("medusa1", "medusa"): "medusa",  # medusa-llm's training save
}
# formats whose consumer writes no checkpoint of its own: the export is checked by loading it in
# the consumer; here it is held to the model the consumer builds from the export's config (and,
# for SGLang's EAGLE-3, to the file SpecForge writes for it)
READ_ONLY = {
    "vllm": "scripts/interop/check_vllm.py feeds every tensor through vLLM's load_weights (make interop)",
    "sglang": "scripts/interop/check_sglang.py runs SGLang's own load_weights on it (make interop)",
    "llama.cpp": "llama.cpp's converter and libllama load it (tests/test_llamacpp_export.py, -m llamacpp)",
    "dspark": "scripts/interop/check_vllm.py runs vLLM's Qwen3DSparkModel load_weights and engine on it (make interop)",
}
# tensors of flags no producer fixture sets (EAGLE-3.1's per-feature norms, P-EAGLE's mask
# stand-in): named by the layouts' docs (docs/formats.md), added to the base key set
FLAG_KEYS = {"eagle31": {"fc_norm.0.weight", "fc_norm.1.weight", "fc_norm.2.weight"}, "peagle": {"mask_hidden"}}


def written(out) -> tuple[dict, dict[str, tuple[int, ...]]]:
    cfg = json.loads((out / CONFIG_NAME).read_text())
    weights = next(out / name for name in (WEIGHTS_NAME, "pytorch_model.bin", "medusa_lm_head.pt") if (out / name).exists())
    if weights.suffix in (".bin", ".pt"):
        return cfg, {k: tuple(v.shape) for k, v in torch.load(weights, weights_only=True).items()}
    with safe_open(str(weights), "pt") as f:
        return cfg, {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}


def layer_shapes(config_class, fields: dict, layer_class, prefixes) -> dict[str, tuple[int, ...]]:
    """{name: shape} of the decoder layer `layer_class` builds from `fields` (the config keys
    `config_class` knows), once under each of `prefixes`."""
    known = config_class().to_dict()
    config = config_class(**{k: v for k, v in fields.items() if k in known and k not in ("architectures", "model_type")})
    layer = {k: tuple(v.shape) for k, v in layer_class(config, 0).state_dict().items()}
    return {f"{prefix}{k}": shape for prefix in prefixes for k, shape in layer.items()}


def consumer_shapes(kind: str, fmt: str, cfg: dict) -> dict[str, tuple[int, ...]]:
    """{name: shape} of every tensor the consumer's model takes from this layout, sized from the
    export's own config as the consumer sizes its modules (docs/formats.md, per layout): the
    decoder layers through transformers' Llama (Qwen3 for DFlash) layer, the rest by hand."""
    if fmt == "medusa":  # head h: medusa_num_layers ResBlocks of [H, H] + bias, then [V, H]
        H, V, L = cfg["hidden_size"], cfg["vocab_size"], cfg["medusa_num_layers"]
        shapes = {}
        for h in range(cfg["medusa_num_heads"]):
            for i in range(L):
                shapes[f"{h}.{i}.linear.weight"], shapes[f"{h}.{i}.linear.bias"] = (H, H), (H,)
            shapes[f"{h}.{L}.weight"] = (V, H)
        return shapes
    if kind in ("dflash", "dspark"):  # fc over the fused target layers, Qwen3 layers, two norms; embedding and LM head: the target's
        layer_cfg = cfg["transformer_layer_config"] if fmt == "speculators" else cfg
        ids = cfg["aux_hidden_state_layer_ids"] if fmt == "speculators" else cfg["dflash_config"]["target_layer_ids"]
        H, n = layer_cfg["hidden_size"], len(ids)
        layers = [f"layers.{i}." for i in range(layer_cfg["num_hidden_layers"])]
        shapes = {
            **layer_shapes(Qwen3Config, layer_cfg, Qwen3DecoderLayer, layers),
            "fc.weight": (H, n * H),
            "hidden_norm.weight": (H,),
            "norm.weight": (H,),
        }
        if kind == "dspark":  # vLLM's Qwen3DSparkModel and speculators' DSparkDraftModel: the Markov head, and
            # the confidence head when enabled
            V, r = layer_cfg["vocab_size"], cfg["markov_rank"]
            shapes.update({"markov_head.markov_w1.weight": (V, r), "markov_head.markov_w2.weight": (V, r)})
            if cfg["enable_confidence_head"]:
                width = H + (r if cfg["confidence_head_with_markov"] else 0)
                shapes.update({"confidence_head.proj.weight": (1, width), "confidence_head.proj.bias": (1,)})
        return shapes
    layer_cfg = cfg["transformer_layer_config"] if fmt == "speculators" else cfg
    H, V = layer_cfg["hidden_size"], layer_cfg["vocab_size"]
    if kind == "eagle1":  # fc over cat(embedding, feature); layer 0 without input_layernorm
        shapes = layer_shapes(LlamaConfig, layer_cfg, LlamaDecoderLayer, ["layers.0."])
        del shapes["layers.0.input_layernorm.weight"]
        shapes["fc.weight"] = (H, 2 * H)
        if fmt == "sglang" or (fmt == "eagle" and cfg.get("bias", True)):  # SGLang's fc always has one
            shapes["fc.bias"] = (H,)
        if fmt == "eagle":  # upstream EAGLE loads strictly, its own embedding included
            shapes["embed_tokens.weight"] = (V, H)
        return shapes
    T = cfg.get("target_hidden_size") or H
    ids = cfg.get("eagle_aux_hidden_state_layer_ids") or cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    D = cfg.get("draft_vocab_size") or V
    layer = "layers.0." if fmt == "speculators" else "midlayer."
    shapes = layer_shapes(LlamaConfig, layer_cfg, LlamaDecoderLayer, [layer])
    for name in ("q_proj", "k_proj", "v_proj"):  # EAGLE-3's attention reads cat(embedding, hidden)
        rows, _ = shapes[f"{layer}self_attn.{name}.weight"]
        shapes[f"{layer}self_attn.{name}.weight"] = (rows, 2 * H)
    shapes.update({f"{layer}hidden_norm.weight": (H,), "fc.weight": (H, len(ids) * T), "norm.weight": (H,), "lm_head.weight": (D, H)})
    if D < V:  # draft id -> target id offsets, and the target-vocab mask the engines skip by name
        shapes.update({"d2t": (D,), "t2d": (V,)})
    if fmt == "speculators":  # speculators stores the (target's) embedding; the engines share the target's
        shapes["embed_tokens.weight"] = (V, H)
    if cfg.get("fc_norm"):  # EAGLE-3.1: one norm per fused feature
        shapes.update({f"fc_norm.{i}.weight": (T,) for i in range(len(ids))})
    if cfg.get("norm_before_fc"):
        shapes["input_norm.weight"] = (len(ids) * T,)
    if cfg.get("speculators_model_type") == "peagle":  # the placeholder for a missing feature, before fc
        shapes["mask_hidden"] = (1, 1, len(ids) * T)
    return shapes


# The consumers' config classes: a key of the producer's config that our export leaves out must be
# one the class fills with the producer's own value (its default); every key we add must be one
# the consumer reads (a field of its class, a flag docs/formats.md names) or our `drafthead` block.
CONFIG_CLASS = {"dflash": Qwen3Config, "medusa": PretrainedConfig, "speculators": PretrainedConfig}
READ_KEYS = {
    "norm_before_residual",
    "norm_before_fc",
    "fc_norm",
    "norm_output",
    "mask_token_id",
    "bias",
    "target_hidden_size",
    "draft_vocab_size",
    "eagle_config",
    "eagle_aux_hidden_state_layer_ids",
    "medusa_num_heads",
    "medusa_num_layers",
    "base_model_name_or_path",
    "medusa_fc_bias",
    "hidden_size",
    "vocab_size",
}  # the last two: vLLM's Medusa config, which assumes 4096 without them
# transformers 5's field -> its transformers 4 names, which every consumer's config class still reads
SAME_FIELD = {"dtype": ("torch_dtype",), "rope_parameters": ("rope_theta", "rope_scaling")}
OLD_NAMES = {old for names in SAME_FIELD.values() for old in names}
# written by the producer's save_pretrained for its own loading, read by no consumer (speculators'
# auto_map names the config.py copy its save writes, dropped from the fixtures)
NOT_READ = {"transformers_version", "auto_map"}
# what the consumers' own config classes give an absent key where transformers' class has no such
# field: speculators' Eagle3 config (a training flag, untied embeddings, one full-attention layer)
# and upstream EAGLE's transformers-4 config (no RoPE scaling)
CONSUMER_DEFAULTS = {
    "embed_requires_grad": False,
    "tie_word_embeddings": False,
    "layer_types": ["full_attention"],
    "use_sliding_window": False,
    "rope_scaling": None,
}


def inert(key: str, theirs: dict) -> bool:
    """A window size that no layer of the producer's config uses (no sliding_attention layer)."""
    return key == "sliding_window" and "sliding_attention" not in theirs.get("layer_types", ())


def config_key_differences(ours: dict, theirs: dict, config_class) -> list[str]:
    """What in our config's keys the consumer would not read as the producer's file says, one
    line each: a key missing that the class does not default to the producer's value, or a key
    added that the consumer does not know."""
    defaults = config_class().to_dict()
    problems = []
    for key in sorted(set(theirs) - set(ours)):
        default = defaults.get(key, CONSUMER_DEFAULTS.get(key, ...))  # ...: no default, the key must be there
        if key in NOT_READ or set(SAME_FIELD.get(key, ())) & set(ours) or default == theirs[key] or inert(key, theirs):
            continue
        problems.append(f"missing {key} = {theirs[key]!r}")
    for key in sorted(set(ours) - set(theirs)):
        if key == "drafthead" or key in defaults or key in READ_KEYS or key in OLD_NAMES:
            continue
        problems.append(f"added {key}")
    return problems


def expected_refusal(target, fmt: str) -> str | None:
    """What the export to `fmt` must refuse for, from the target's own config: upstream EAGLE's
    fixed RoPE (base 10000, whatever the config says)."""
    rope = target.config.get_text_config().rope_parameters  # a multimodal target's is its language model's
    rope = rope.get("full_attention", rope)  # Gemma 3: one RoPE per layer type
    if fmt == "eagle" and (rope.get("rope_type") != "default" or rope.get("rope_theta") != 10000.0):
        return "RoPE with base 10000"
    return None


@pytest.mark.parametrize("kind", sorted({**KINDS, **EXPORT_KINDS}))
@pytest.mark.parametrize("family", TARGETS + sorted(set(HYBRID_TARGETS) - NOPE_HYBRIDS))
def test_exports_write_what_the_consumer_loads_or_refuse_in_one_line(family, kind, tmp_path):
    """Each export holds exactly the tensors, of exactly the shapes, that the consumer's model
    built from the export's own config takes; where the consumer's code writes this layout too,
    the same tensor names and config keys as its checkpoint (tests/fixtures/interop)."""
    head = head_of(family, kind)
    head.save_pretrained(tmp_path / "head")
    target = target_of(family)
    for fmt in formats_for(kind):
        out = tmp_path / fmt
        why = expected_refusal(target, fmt)
        if why is not None:
            with pytest.raises(ValueError) as refused:
                export_head(tmp_path / "head", out, fmt, target_model=target)
            message = str(refused.value)
            assert "\n" not in message and message.startswith(consumer(fmt)) and why in message, message
            continue
        export_head(tmp_path / "head", out, fmt, target_model=target)
        cfg, shapes = written(out)
        expected = consumer_shapes(kind, fmt, cfg)
        assert set(shapes) == set(expected), f"{fmt}: unexpected {sorted(set(shapes) - set(expected))}, missing {sorted(set(expected) - set(shapes))}"
        wrong = {k: (shapes[k], expected[k]) for k in shapes if shapes[k] != expected[k]}
        assert not wrong, f"{fmt}: (written, the consumer's) shapes differ: {wrong}"
        base = "eagle3" if kind in ("eagle31", "peagle") else kind
        fixture = WRITTEN_BY_CONSUMER.get((base, fmt))
        if fixture is None:
            assert fmt in READ_ONLY, f"{fmt}: no consumer-written fixture and not a read-only consumer"
            continue
        assert set(shapes) == fixture_keys(fixture) | FLAG_KEYS.get(kind, set()), f"{fmt}: tensor names differ from {fixture}'s"
        theirs = json.loads((ROOT / fixture / CONFIG_NAME).read_text())
        problems = config_key_differences(cfg, theirs, CONFIG_CLASS.get(fmt, LlamaConfig))
        if fmt == "speculators":  # the layer's own config inside it
            layer_class = Qwen3Config if theirs["transformer_layer_config"].get("model_type") == "qwen3" else LlamaConfig
            problems += config_key_differences(cfg["transformer_layer_config"], theirs["transformer_layer_config"], layer_class)
        assert not problems, f"{fmt} config against {fixture}'s: {problems}"


# fixture -> (kind, format) of the layout its producer wrote, for the fixtures of that table
FIXTURE_LAYOUTS = {
    "eagle1": ("eagle1", "eagle"),
    "medusa": ("medusa1", "medusa"),
    "dflash": ("dflash", "dflash"),
    "specforge-sglang": ("eagle3", "sglang"),
    "speculators-eagle3": ("eagle3", "speculators"),
    "speculators-eagle3-nbr": ("eagle3", "speculators"),
    "speculators-eagle3-train": ("eagle3", "speculators"),  # + input_norm (norm_before_fc)
    "speculators-eagle3-window": ("eagle3", "speculators"),
    "speculators-dspark": ("dspark", "speculators"),
}


@pytest.mark.parametrize("fixture", sorted(FIXTURE_LAYOUTS))
def test_consumer_shapes_are_those_of_the_consumers_own_checkpoints(fixture):
    """The sizing rule the export test holds our exports to gives, from each consumer-written
    fixture's own config, exactly that checkpoint's names and shapes: the rule is the consumers'."""
    cfg, shapes = written(ROOT / fixture)
    if fixture == "medusa":  # upstream Medusa's config leaves the sizes to its base model
        base = json.loads((ROOT / "target" / CONFIG_NAME).read_text())
        cfg = {**cfg, "hidden_size": base["hidden_size"], "vocab_size": base["vocab_size"]}
    assert shapes == consumer_shapes(*FIXTURE_LAYOUTS[fixture], cfg)


def test_the_layout_checks_see_a_wrong_shape_a_missing_tensor_and_a_lost_key(tmp_path):
    """Negative controls for the export test: an EAGLE-3 `sglang` export with fc's input width
    wrong, t2d missing or eagle_config lost fails the check that names it."""
    head_of("llama", "eagle3").save_pretrained(tmp_path / "head")
    cfg, shapes = written(export_head(tmp_path / "head", tmp_path / "out", "sglang", target_model=target_of("llama")))
    expected = consumer_shapes("eagle3", "sglang", cfg)
    assert shapes == expected
    assert {**shapes, "fc.weight": (32, 64)} != expected
    assert set(shapes) - {"t2d"} != fixture_keys("specforge-sglang")
    theirs = json.loads((ROOT / "specforge-sglang" / CONFIG_NAME).read_text())
    assert config_key_differences(cfg, theirs, LlamaConfig) == []
    lost = {k: v for k, v in cfg.items() if k != "eagle_config"}
    assert config_key_differences(lost, theirs, LlamaConfig) == [f"missing eagle_config = {theirs['eagle_config']!r}"]
    assert config_key_differences({**cfg, "eagle_ids": [1]}, theirs, LlamaConfig) == ["added eagle_ids"]


# ----------------------------------------------------------------------------- the family's own layer


def test_a_head_saved_with_its_family_layer_loads_drafts_and_refuses_export(tmp_path):
    """A Qwen3 head saved with `draft_layer: target` holds Qwen3's own layer with q/k norms: it
    loads as that layer and drafts exactly; speculators serves it (its Qwen3 EAGLE-3 layer) and it
    imports back, on a Qwen3 target only; every other engine export refuses in one line naming
    the engine."""
    from drafthead.heads.registry import load_head

    target = target_of("qwen3")
    config = make_config("eagle3", target, None, name="tiny-qwen3", **KINDS["eagle3"], draft_layer="target")
    folder = build_head(config, target, token_counts=torch.arange(V)).save_pretrained(tmp_path / "family-layer")
    head, _ = load_head(folder, target, None, target_name="tiny-qwen3")
    assert head.config.draft_layer == "target" and "midlayer.self_attn.q_norm.weight" in head.state_dict()
    assert_greedy_equals_plain(
        target, lambda num_draft=8: EagleDrafter(head, TreeSettings(num_draft=num_draft, depth=3, branch=2)), max_new_tokens=12, trees=(None,)
    )
    from drafthead.heads.formats import import_head
    from drafthead.heads.io import HeadFormatError
    from tests.head_checks import outputs

    for fmt in formats_for("eagle3"):
        if fmt == "speculators":
            continue
        with pytest.raises(ValueError) as refused:
            export_head(folder, tmp_path / fmt, fmt)
        message = str(refused.value)
        assert "\n" not in message and message.startswith(f"{consumer(fmt)} serves a Llama draft layer") and "qwen3" in message
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
    from tests.head_checks import outputs

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
    from tests.head_checks import outputs

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


@pytest.mark.parametrize(
    "family,fmt,own",
    [
        # SpecForge's MoE configs pick their own MLP width (12288 for Qwen3-30B-A3B, whose config says 6144)
        ("qwen3_moe", "vllm", {"intermediate_size": 48}),
        # speculators' trainer gives the draft its verifier's activation (Gemma 3: GELU-tanh)
        ("gemma3", "speculators", {"hidden_act": "gelu_pytorch_tanh"}),
        # SpecForge's DeepSeek-V3 config states no head_dim: hidden / heads, not the MLA target's field
        ("deepseek_v3", "sglang", {"head_dim": 8}),
    ],
)
def test_a_producers_own_draft_layer_fields_are_kept_on_import(family, fmt, own, tmp_path):
    from drafthead.heads.formats import import_head
    from tests.head_checks import outputs

    target = target_of(family)
    config = make_config("eagle3", target, None, name=f"tiny-{family}", **KINDS["eagle3"], layer=own)
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
    assert {k: getattr(back.config.layer, k) for k in own} == own
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
    assert any("names no eagle_aux_hidden_state_layer_ids: read with the engines' default capture points" in n for n in notes), notes
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
