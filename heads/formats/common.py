"""What every foreign layout shares: what a format module declares (the layouts it reads, the
exports it writes), reading its files, the aux-layer id conventions, the `drafthead` provenance
block, and the record an importer hands back (docs/formats.md)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from ..io import CONFIG_NAME, FORMAT, drafthead_version
from ..io import HeadFormatError
from ...ground.files import read_json, read_safetensors

# How a checkpoint numbers the target hidden states an EAGLE-3 head fuses. Ours (heads/config.py)
# are transformers `output_hidden_states` indices: id i = the input of decoder layer i.
#   vllm:   the same numbers (vLLM, speculators, llama.cpp, drafthead)
#   sglang: one lower: SGLang adds 1 to every id before capturing (SGLang, SpecForge)
ID_OFFSETS = {"vllm": 0, "sglang": 1}

# The speculators release whose layout our `speculators` exports write (EAGLE-3 and DSpark alike).
SPECULATORS_VERSION = "0.9.0"

# Files a foreign head keeps its weights in, in the order they are looked for.
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


@dataclass
class ForeignHead:
    """A foreign checkpoint translated into our terms, before it meets the target.

    kind, overrides: what `heads.registry.make_config(kind, target, **overrides)` needs.
    state: tensors under OUR names, exactly as stored (no approximation).
    target_copies: tensors the producer stored but we read from the target (e.g. embed_tokens):
      the importer checks each equals the target's and refuses otherwise.
    config: our full config dict when the checkpoint carries a `drafthead` block (then the target
      identity is checked too); None for a foreign producer.
    notes: what the import decided (printed by the CLI).
    """

    layout: str
    kind: str
    overrides: dict
    state: dict[str, torch.Tensor]
    target_copies: dict[str, torch.Tensor] = field(default_factory=dict)
    config: dict | None = None
    notes: list[str] = field(default_factory=list)
    layer_fields: dict = field(default_factory=dict)  # the decoder layer's config as the checkpoint states it
    # rows of a target copy that are the head's own (P-EAGLE's mask-token row), not compared with the target
    copy_rows_own: dict[str, tuple[int, ...]] = field(default_factory=dict)


@dataclass(frozen=True)
class Layout:
    """A published layout one format module reads. `detect(src, cfg)` says whether the folder
    `src` with config.json `cfg` holds it (for an `on_file` layout, `src` is a file and `cfg` None);
    `kind(cfg)` is the head kind it is read into, before its weights are; `read(src, cfg,
    convention)` translates it (a ForeignHead), or refuses it in one line."""

    name: str
    detect: Callable[..., bool]
    kind: Callable[..., str]
    read: Callable[..., ForeignHead]
    on_file: bool = False


@dataclass(frozen=True)
class ExportJob:
    """One head to write in one export format: our config, folder metadata and tensors (cast to
    the asked dtype), and the head's target when the caller gave it."""

    fmt: str
    config: object
    meta: dict
    state: dict[str, torch.Tensor]
    target_model: Any = None
    dtype: torch.dtype | None = None

    def target_tensor(self, get) -> torch.Tensor | None:
        """A target tensor the layout stores a copy of (`get(model)` is a module with a weight), in
        the target's dtype unless a dtype was asked; None without a target."""
        if self.target_model is None:
            return None
        w = get(self.target_model).weight
        return w if self.dtype is None else w.to(self.dtype)

    @property
    def verifier(self) -> str | None:
        """The target's name or path, as consumers that record their verifier store it."""
        if self.target_model is None:
            return None
        return str(getattr(self.target_model.config, "_name_or_path", "") or "") or None


@dataclass(frozen=True)
class Export:
    """An export format (`--format NAME`) for some head kinds, as one module writes it: `write(job)`
    returns (config.json dict, tensors). `consumer` names the code that loads it (refusals start
    with it; docs/formats.md has the versions each was checked against). `weights`: the file the
    tensors go to (.safetensors, else torch.save). `served_layer`: the head's draft layer must be
    one the consumer builds (served_layer_refusal); False where the head embeds no draft layer of
    its own choosing (Medusa, a target's own MTP layer)."""

    format: str
    kinds: tuple[str, ...]
    consumer: str
    write: Callable[[ExportJob], tuple[dict, dict]]
    weights: str = "model.safetensors"
    served_layer: bool = True


# Decoder-layer fields that change the maths without changing any tensor's shape, or that must
# agree with the target's for our layer (built from the target's config) to be the checkpoint's.
CHECKED_LAYER_FIELDS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps")


def layer_field_diffs(stated: dict, built) -> list[str]:
    """'field: checkpoint X != ours Y' for every CHECKED_LAYER_FIELDS entry both sides state, plus a
    sliding-window draft layer in a layout that cannot say its window to us (the speculators reader
    takes the window into Eagle3Config.sliding_window and removes the fields first)."""
    out = []
    types = stated.get("layer_types") or []
    if any(t != "full_attention" for t in types) or stated.get("use_sliding_window"):
        out.append(
            f"layer_types {types} / use_sliding_window {stated.get('use_sliding_window')}: the checkpoint's "
            "draft layer attends a sliding window this layout's reader does not carry over"
        )
    for name in CHECKED_LAYER_FIELDS:
        mine = getattr(built, name, None)
        if name not in stated or stated[name] is None or mine is None:
            continue
        theirs = stated[name]
        same = abs(float(theirs) - float(mine)) <= 1e-6 * abs(float(mine)) if name == "rms_norm_eps" else theirs == mine
        if not same:
            out.append(f"{name}: checkpoint {theirs!r} != target's {mine!r}")
    return out


def read_config(src: Path) -> dict:
    return read_json(src / CONFIG_NAME)


def read_weights(src: Path, names=WEIGHT_FILES) -> dict[str, torch.Tensor]:
    """The first of `names` found in `src`; a `.bin`/`.pt` is read with `weights_only=True`
    (no pickled code runs)."""
    for name in names:
        path = src / name
        if not path.is_file():
            continue
        if path.suffix == ".safetensors":
            return read_safetensors(path)
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # truncated zip, pickle with code, ...
            raise HeadFormatError(f"{path} is not a readable weights-only torch file: {e}") from e
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise HeadFormatError(f"{path} does not hold a flat state dict of tensors")
        return dict(state)
    raise HeadFormatError(f"no weights file in {src} (looked for {', '.join(names)})")


class ConventionNeeded(HeadFormatError):
    """The layout leaves open how its producer counted (aux ids, RoPE): the caller must say."""


def need_convention(convention: str | None, allowed: tuple[str, ...], why: str) -> str:
    if convention is None:
        raise ConventionNeeded(f"{why}: say which with convention= / --convention ({' or '.join(allowed)})")
    if convention not in allowed:
        raise HeadFormatError(f"convention {convention!r} does not apply here ({why}); use {' or '.join(allowed)}")
    return convention


def ids_to_ours(ids, convention: str) -> tuple[int, ...]:
    """A checkpoint's aux-layer ids -> our output_hidden_states indices."""
    return tuple(int(i) + ID_OFFSETS[convention] for i in ids)


def ids_from_ours(layers, convention: str) -> list[int]:
    out = [int(i) - ID_OFFSETS[convention] for i in layers]
    if any(i < 0 for i in out):
        raise ValueError(f"aux layers {tuple(layers)} cannot be written in {convention}'s convention (it cannot name the embedding output)")
    return out


def refuse_unknown(meta: dict, field_name: str, supported, where: str) -> None:
    """A config flag whose value we cannot run exactly: refuse, naming it."""
    if field_name in meta and meta[field_name] not in supported:
        raise HeadFormatError(
            f"{where}: {field_name}={meta[field_name]!r} is not supported "
            f"(drafthead runs {', '.join(map(repr, supported))}); refusing rather than approximating"
        )


def dtype_name(state: dict[str, torch.Tensor]) -> str:
    floats = sorted({str(v.dtype).removeprefix("torch.") for v in state.values() if v.is_floating_point()})
    return floats[0] if len(floats) == 1 else "float32"


def drafthead_block(meta: dict) -> dict:
    """Provenance written into every export's config.json: HF-style config loaders keep unknown
    keys, and an import back into drafthead uses it to check the target identity."""
    return {"format": FORMAT, "drafthead_version": meta.get("drafthead_version", drafthead_version()), "config": meta["config"]}


def rope_fields(layer_cfg: dict) -> dict:
    """transformers v5 keeps RoPE in `rope_parameters`; engines read `rope_theta`/`rope_scaling`."""
    out = {}
    rp = layer_cfg.get("rope_parameters") or {}
    theta = layer_cfg.get("rope_theta", rp.get("rope_theta"))
    if theta is not None:
        out["rope_theta"] = theta
    scaling = layer_cfg.get("rope_scaling")
    if scaling is None and rp and rp.get("rope_type", "default") != "default":
        scaling = {k: v for k, v in rp.items() if k != "rope_theta"}
    if scaling is not None:
        out["rope_scaling"] = scaling
    return out


def rope_parameters_of(cfg: dict) -> dict | None:
    """A foreign config's RoPE as our `rope_parameters` (None when it states none)."""
    rp = cfg.get("rope_parameters")
    if rp:
        return dict(rp)
    theta = cfg.get("rope_theta")
    if theta is None:
        return None
    scaling = dict(cfg.get("rope_scaling") or {})
    scaling.setdefault("rope_type", scaling.pop("type", "default"))
    return {**scaling, "rope_theta": float(theta)}


def layer_config(meta: dict) -> dict:
    lc = meta.get("layer_config")
    if not lc:
        raise HeadFormatError("head config.json has no layer_config (needed to describe the decoder layer)")
    return lc


# Llama config fields the engines' draft layers read, copied from our draft layer's HF config.
LLAMA_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "rms_norm_eps",
    "max_position_embeddings",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "initializer_range",
    "mlp_bias",
)


def llama_layer_fields(lc: dict) -> dict:
    out = {k: lc[k] for k in LLAMA_FIELDS if k in lc and lc[k] is not None}
    out.update(rope_fields(lc))
    return out


def drop_zero_extra(head_state: dict, state: dict, key: str, where, why: str) -> None:
    """A tensor an engine layout carries but the head has no place for (`why`): dropped when it is
    all zero, which is exact (it only ever adds zero), refused otherwise."""
    if key in state and key not in head_state:
        if bool(state[key].abs().max() > 0):
            raise HeadFormatError(f"{where}: non-zero {key}, but {why}")
        del state[key]


# Target families whose own decoder layer is Llama's up to attention biases (which each layout's
# writer handles): a head saved with draft_layer "target" for one of them exports as a Llama layer.
LLAMA_LIKE_FAMILIES = ("llama", "mistral", "qwen2")

# Family draft layers a consumer serves under that family's own type, per export format (beyond
# LLAMA_LIKE_FAMILIES): speculators builds a Qwen3 EAGLE-3 first layer (q/k norms) when its
# transformer_layer_config says model_type qwen3 (speculators 0.9 models/eagle3/model_definitions.py).
FAMILY_LAYER_FORMATS = {"speculators": ("qwen3",)}


def served_layer_refusal(config, engine: str, fmt: str = "") -> str | None:
    """Why `engine` would not run this head's draft layer as trained, in one line; None when it
    would. Engines serve a Llama draft layer whatever the target (docs/formats.md "The draft layer
    per target family")."""
    family = config.target.model_type
    layer = getattr(config, "layer", None)  # the draft layer's own shape: EAGLE and DFlash configs
    act = None if layer is None else layer.hidden_act
    if act not in (None, "silu") and fmt != "speculators":
        return (
            f"{engine}'s Llama draft MLP runs SiLU only and refuses {act} at load; this head's layer uses it "
            "(its producer copied the target's): export it with --format speculators"
        )
    if getattr(config, "draft_layer", "llama") == "target" and family not in LLAMA_LIKE_FAMILIES and family not in FAMILY_LAYER_FORMATS.get(fmt, ()):
        return (
            f"{engine} serves a Llama draft layer, but this head keeps its {family} target's own layer "
            "(saved with draft_layer=target), whose extra or fused tensors it would drop or miss: "
            "retrain it with draft_layer=llama"
        )
    return None
