"""Foreign head layouts: export our heads to what serving engines load, and import what other
trainers publish (docs/formats.md has every layout and the engine versions each was run against).

Export formats (`export_head(head_dir, out_dir, fmt)`):
    ours         our own folder, re-saved (optionally cast)
    vllm         EAGLE-3 / EAGLE-1 research layout, vLLM's aux-id convention
    speculators  EAGLE-3 in vLLM's preferred format (speculators library), every flag explicit; DSpark too
    sglang       EAGLE-3 / EAGLE-1 research layout, SGLang's aux-id convention (one lower)
    llama.cpp    EAGLE-3 folder for llama.cpp's convert_hf_to_gguf.py (top-level aux ids)
    eagle        upstream EAGLE-1 (eagle-llm): pytorch_model.bin with embed_tokens and fc.bias
    medusa       upstream Medusa (medusa-llm): medusa_lm_head.pt
    dflash       DFlash's DFlashDraftModel (vLLM method dflash, SGLang DFLASH, z-lab dflash)
    dspark       DSpark's Qwen3DSparkModel, DeepSeek's layout (vLLM method dspark, llama.cpp's converter)
    mtp          a target's own MTP layer, in its checkpoint's names (vLLM deepseek_mtp, SGLang NextN)

Import (`import_head(src, target, convention=...)`) reads all of them, plus llama.cpp's converted
draft GGUF, the old vLLM Medusa layout and SpecForge's `to_hf` output. Where a layout does not say how it numbers aux layers or which
RoPE it ran, `convention` must (vllm / sglang / eagle); nothing is guessed. Every tensor lands in our
head exactly or the import is refused naming it.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import cast

import torch
from torch import nn

from ..config import DRAFT_OWN_FIELDS, DraftLayerShape, Eagle3Config, config_from_dict, head_kind
from ...ground.target.identity import HeadTargetMismatch, check_compatible, identify_target, identity_diff
from ..io import ADAPTER_DIR, CONFIG_NAME, FORMAT, WEIGHTS_NAME, check_state_dict, read_head_dir
from ..io import HeadFormatError
from ...ground.files import write_json, write_safetensors
from ...ground.outdir import check_distinct, check_output, fresh_folder
from . import dflash, dspark, eagle1, eagle3, gguf_eagle3, medusa, mtp, speculators
from ...ground.target.parts import input_embeddings, lm_head_of
from .common import (
    Export,
    ExportJob,
    ForeignHead,
    Layout,
    drafthead_block,
    drop_zero_extra,
    dtype_name,
    layer_field_diffs,
    read_config,
    served_layer_refusal,
)

# The format modules, each declaring the layouts it reads (LAYOUTS) and the exports it writes
# (EXPORTS; heads/formats/common.py); a layout is detected in this order, a file's first.
_MODULES = (gguf_eagle3, speculators, dflash, dspark, medusa, eagle3, eagle1, mtp)
LAYOUTS: dict[str, Layout] = {layout.name: layout for m in _MODULES for layout in getattr(m, "LAYOUTS", ())}
_EXPORTS: tuple[Export, ...] = tuple(e for m in _MODULES for e in getattr(m, "EXPORTS", ()))
EXPORT_FORMATS = ("ours", *dict.fromkeys(e.format for e in _EXPORTS))
CONVENTIONS = ("vllm", "sglang", "eagle")
IDENTITY_VOCAB_KEYS = ("d2t", "t2d")  # EAGLE-3's draft-vocab maps, the identity when Vd == V


def format_kinds(fmt: str) -> tuple[str, ...]:
    """The head kinds export format `fmt` carries."""
    return tuple(k for e in _EXPORTS if e.format == fmt for k in e.kinds)


def formats_for(kind: str) -> list[str]:
    """The export formats a `kind` head can be written in ("ours" aside)."""
    return list(dict.fromkeys(e.format for e in _EXPORTS if kind in e.kinds))


def consumer(fmt: str) -> str:
    """Whose code loads export format `fmt`, as refusals name it."""
    return next(e.consumer for e in _EXPORTS if e.format == fmt)


def _export_of(fmt: str, kind: str) -> Export:
    """The Export that writes a `kind` head in `fmt`, or a one-line refusal saying where it can go."""
    if head_kind(kind).adapts_target:
        raise ValueError(f"a {kind} head changes the target (LoRA adapter); no engine format carries the adapter")
    for e in _EXPORTS:
        if e.format == fmt and kind in e.kinds:
            return e
    raise ValueError(
        f"--format {fmt} carries {' / '.join(format_kinds(fmt))} heads, not {kind} "
        f"(a {kind} head exports as: {', '.join(formats_for(kind)) or 'ours only'})"
    )


# ----------------------------------------------------------------------------- export


def export_head(
    head_dir, out_dir, fmt: str, *, dtype: torch.dtype | None = None, target_model: nn.Module | None = None, overwrite: bool = False
) -> Path:
    """Write `head_dir` (our format) to `out_dir` in layout `fmt` (EXPORT_FORMATS).

    dtype: cast floating tensors (e.g. torch.bfloat16). target_model: needed where the layout stores
    a copy of a target tensor (upstream EAGLE's embed_tokens, speculators' embed_tokens, a shared
    Medusa LM head); it must be the head's own target. A non-empty `out_dir` is refused unless
    `overwrite`; the folder is written beside it and renamed in whole (ground/outdir.py), so no
    file of an earlier export is left to be read instead of the new ones.
    """
    if fmt not in EXPORT_FORMATS:
        raise ValueError(f"unknown export format {fmt!r} (known: {', '.join(EXPORT_FORMATS)})")
    head_dir, out_dir = Path(head_dir), Path(out_dir)
    check_distinct(head_dir, out_dir)
    check_output(out_dir, overwrite=overwrite, what="export folder")
    config, meta, state = read_head_dir(head_dir)
    with fresh_folder(out_dir, overwrite=overwrite, what="export folder") as tmp:
        _write_export(head_dir, tmp, fmt, config, meta, state, dtype, target_model)
    return out_dir


def _write_export(head_dir: Path, out_dir: Path, fmt: str, config, meta: dict, state: dict, dtype, target_model) -> None:
    """export_head's body: the layout `fmt` written into the (new, empty) folder `out_dir`."""
    if dtype is not None:
        state = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in state.items()}

    if fmt == "ours":
        out_dir.mkdir(parents=True, exist_ok=True)
        if (head_dir / ADAPTER_DIR).exists():
            shutil.copytree(head_dir / ADAPTER_DIR, out_dir / ADAPTER_DIR, dirs_exist_ok=True)
        write_safetensors(out_dir / WEIGHTS_NAME, state, {"format": "pt"})
        write_json(out_dir / CONFIG_NAME, {**meta, "dtype": dtype_name(state)})
        return

    export = _export_of(fmt, config.kind)
    if export.served_layer:
        refusal = served_layer_refusal(config, export.consumer, fmt)
        if refusal is not None:
            raise ValueError(refusal)
    if target_model is not None:
        diffs = identity_diff(config.target, identify_target(target_model))
        if diffs:
            raise HeadTargetMismatch("target_model is not this head's target:\n  " + "\n  ".join(diffs))
    if head_kind(config.kind).draft_vocab and config.draft_vocab_size == config.vocab_size:
        # a full draft vocabulary maps every id to itself: the engines then build no d2t / t2d
        # (vLLM refuses them as unknown parameters), and the import restores the identity
        state = {k: v for k, v in state.items() if k not in IDENTITY_VOCAB_KEYS}
    cfg, tensors = export.write(ExportJob(fmt, config, meta, state, target_model, dtype))
    cfg["torch_dtype"] = dtype_name(tensors)
    cfg["drafthead"] = drafthead_block(meta)
    out_dir.mkdir(parents=True, exist_ok=True)
    if export.weights.endswith(".safetensors"):
        write_safetensors(out_dir / export.weights, tensors, {"format": "pt"})
    else:
        _atomic_torch_save(out_dir / export.weights, tensors)
    write_json(out_dir / CONFIG_NAME, cfg)  # last: the folder is complete once this exists


def _atomic_torch_save(path: Path, tensors: dict) -> None:
    from ...ground.files import atomic_write

    cpu = {k: v.detach().to("cpu").contiguous().clone() for k, v in tensors.items()}
    atomic_write(path, lambda tmp: torch.save(cpu, tmp))


# ----------------------------------------------------------------------------- import


def detect_layout(src_dir) -> str:
    """Which layout a folder (or a llama.cpp .gguf file) holds: "ours" or a name of LAYOUTS."""
    src = Path(src_dir)
    for layout in LAYOUTS.values():
        if layout.on_file and layout.detect(src, None):
            return layout.name
    if not src.is_dir():
        raise HeadFormatError(f"head directory {src} does not exist")
    cfg = read_config(src)
    if cfg.get("format") == FORMAT:
        return "ours"
    for layout in LAYOUTS.values():
        if not layout.on_file and layout.detect(src, cfg):
            return layout.name
    raise HeadFormatError(
        f"cannot tell which head layout {src} holds (architectures={cfg.get('architectures')}); "
        "known: ours, speculators, EAGLE-3 research, EAGLE-1, Medusa, DFlash, DSpark"
    )


def layout_kind(src_dir, layout: str) -> str:
    """The head kind a foreign folder in `layout` is read into (before reading its weights)."""
    entry = LAYOUTS[layout]
    return entry.kind(None if entry.on_file else read_config(Path(src_dir)))


def read_foreign(src_dir, convention: str | None = None) -> ForeignHead:
    """A foreign folder in our terms (no target needed yet)."""
    src = Path(src_dir)
    layout = detect_layout(src)
    if layout == "ours":
        raise ValueError(f"{src} is already a drafthead head folder")
    if convention is not None and convention not in CONVENTIONS:
        raise HeadFormatError(f"unknown convention {convention!r} (known: {', '.join(CONVENTIONS)})")
    entry = LAYOUTS[layout]
    if entry.on_file:
        return entry.read(src, None, convention)
    cfg = read_config(src)
    foreign = entry.read(src, cfg, convention)
    ours = cfg.get("drafthead")
    if ours is not None:
        foreign.config = ours["config"]
        if ours["config"].get("share_lm_head"):  # our Medusa head read the target's LM head: the copies must be it
            for key in [k for k in foreign.state if k.startswith("lm_heads.")]:
                foreign.target_copies[key] = foreign.state.pop(key)
    return foreign


def import_head(src_dir, target_model: nn.Module, tokenizer=None, target_name: str | None = None, convention: str | None = None):
    """Read a head in any known layout onto `target_model` -> the head, bound to the target."""
    return _import(src_dir, target_model, tokenizer, target_name, convention)[0]


def _import(src_dir, target_model: nn.Module, tokenizer=None, target_name: str | None = None, convention: str | None = None):
    """-> (head, notes: what the import decided, the ForeignHead read; None for our own folders).

    Our own folders load as `load_head` does. Foreign ones: the layout is translated
    (`read_foreign`), checked against the target (stored copies of target tensors must equal the
    target's; the decoder layer's shape fields must match), and loaded strictly.
    """
    from ..registry import _new_module, check_draft_vocab, load_head, make_config, target_device, target_dtype

    src = Path(src_dir)
    if detect_layout(src) == "ours":
        return load_head(src, target_model, tokenizer, target_name)[0], [], None
    foreign = read_foreign(src, convention)
    name = target_name or str(getattr(target_model.config, "_name_or_path", "") or "target")
    if foreign.config is not None:
        config = config_from_dict(foreign.config)
        if config.target is None:
            raise HeadFormatError(f"{src}: the drafthead block's config has no target identity")
        check_compatible(config.target, identify_target(target_model, tokenizer, target_name or config.target.name))
    else:
        overrides = dict(foreign.overrides)
        _drop_target_rope(overrides, target_model)
        if head_kind(foreign.kind).engine_layer and overrides.get("draft_layer", "llama") == "llama":
            overrides.update(_own_layer_fields(foreign.layer_fields, target_model))
        # the readers name the draft layer's own fields as the layouts do, beside the others
        layer = {name: overrides.pop(name) for name in LAYER_SHAPE_FIELDS if name in overrides}
        config = make_config(foreign.kind, target_model, tokenizer, name, **overrides, **({"layer": layer} if layer else {}))
    assert config.target is not None  # make_config records it; a drafthead block without one is refused above
    family_layer = foreign.layer_fields.get("model_type", "llama")
    if (
        family_layer != "llama" and getattr(config, "draft_layer", None) == "target" and family_layer != config.target.model_type
    ):  # a family's own layer (Llama-labelled ones: Qwen2, Mistral)
        raise HeadFormatError(
            f"{src}: the checkpoint's draft layer is {family_layer}'s, which drafthead builds only "
            f"on a {family_layer} target, not on this {config.target.model_type} one"
        )
    head = _new_module(config, target_model)
    diffs = layer_field_diffs(foreign.layer_fields, getattr(head, "_layer_cfg", None))
    if diffs:
        raise HeadFormatError(f"{src}: the checkpoint's decoder layer is not the target family's:\n  " + "\n  ".join(diffs))
    expected = head.state_dict()
    state = dict(foreign.state)
    if head_kind(foreign.kind).draft_vocab:  # the engines' Llama layer has an o_proj bias where Qwen2's has none
        drop_zero_extra(expected, state, eagle3.O_BIAS, src, "the target family's attention has no o_proj bias")
    # draft_vocab kinds' configs are Eagle3Configs (KINDS)
    if head_kind(foreign.kind).draft_vocab and cast(Eagle3Config, config).draft_vocab_size == config.vocab_size:
        for key in IDENTITY_VOCAB_KEYS:  # left out for a full vocabulary: our fresh head holds the identity
            state.setdefault(key, expected[key])
    check_state_dict(expected, state, where=f"in {src}")
    _check_target_copies(foreign.target_copies, target_model, src, foreign.copy_rows_own)
    head.load_state_dict({k: v.to(expected[k].dtype) for k, v in state.items()}, strict=True)
    check_draft_vocab(head, src)
    head.to(device=target_device(target_model), dtype=target_dtype(target_model))
    head.eval()
    return head.bind_target(target_model), [f"read {src} as {foreign.layout}"] + foreign.notes, foreign


LAYER_SHAPE_FIELDS = tuple(f.name for f in dataclasses.fields(DraftLayerShape))


def _drop_target_rope(overrides: dict, target_model: nn.Module) -> None:
    """A stated RoPE equal to the target's is no override (keeps imported configs like trained ones)."""
    from ...ground.target.identity import text_config

    rope = overrides.get("rope_parameters")
    if rope is None:
        return
    own = dict(getattr(text_config(target_model), "rope_parameters", None) or {})
    if {"rope_type": "default", **own} == {"rope_type": "default", **rope}:
        del overrides["rope_parameters"]


def _own_layer_fields(stated: dict, target_model: nn.Module) -> dict:
    """The draft layer fields a checkpoint states apart from those our Llama layer takes from the
    target (DRAFT_OWN_FIELDS: sizes, activation): a producer's own choice, kept (docs/formats.md
    "The draft layer per target family")."""
    from ..eagle import llama_layer_config
    from ...ground.target.identity import text_config

    built = llama_layer_config(text_config(target_model))
    stated = dict(stated)
    if stated.get("head_dim") is None and stated.get("hidden_size") and stated.get("num_attention_heads"):
        # a Llama config without head_dim means hidden / heads to every consumer (LlamaConfig's
        # default), e.g. SpecForge's DeepSeek-V3 config: 56 heads of 128, the MLA target's are 64
        stated["head_dim"] = int(stated["hidden_size"]) // int(stated["num_attention_heads"])
    return {name: stated[name] for name in DRAFT_OWN_FIELDS if stated.get(name) is not None and stated[name] != getattr(built, name)}


def _check_target_copies(copies: dict, target_model: nn.Module, src, own_rows: dict | None = None) -> None:
    """A checkpoint's copy of a target tensor must be the target's (exactly, up to its dtype), but
    for the rows `own_rows[key]` that belong to the head."""
    for key, stored in copies.items():
        ref = input_embeddings(target_model) if "embed_tokens" in key else lm_head_of(target_model)
        own = ref.weight.detach().to("cpu")
        if tuple(stored.shape) != tuple(own.shape):
            raise HeadFormatError(
                f"{src}: {key} has shape {tuple(stored.shape)}, the target's {tuple(own.shape)}: this head was made for another target"
            )
        rows = list((own_rows or {}).get(key, ()))
        if rows:  # compare everything else: the head's rows set to the target's own
            stored = stored.clone()
            stored[rows] = own[rows].to(stored.dtype)
        if not torch.equal(stored.to(own.dtype), own) and not torch.equal(stored, own.to(stored.dtype)):
            diff = (stored.float() - own.float()).abs().max().item()
            raise HeadFormatError(
                f"{src}: {key} differs from the target's (max abs diff {diff:.3g}); drafthead reads "
                "it from the target, so this head was trained against another one"
            )


def import_to_folder(
    src_dir,
    out_dir,
    target_model: nn.Module,
    tokenizer=None,
    target_name: str | None = None,
    convention: str | None = None,
    dtype: torch.dtype | None = None,
    overwrite: bool = False,
) -> tuple[Path, list[str]]:
    """`drafthead import`: a foreign layout -> one of our head folders. The weights are saved in
    `dtype`, by default the dtype they were stored in (so a bf16 checkpoint stays bit-exact).
    `out_dir` may not be `src_dir`, and a non-empty one is refused unless `overwrite`; it appears
    whole or not at all (ground/outdir.py)."""
    check_distinct(src_dir, out_dir)
    check_output(out_dir, overwrite=overwrite, what="import folder")
    head, notes, foreign = _import(src_dir, target_model, tokenizer, target_name, convention)
    if dtype is None and foreign is not None:
        floats = {v.dtype for v in foreign.state.values() if v.is_floating_point()}
        dtype = floats.pop() if len(floats) == 1 else None
    with fresh_folder(out_dir, overwrite=overwrite, what="import folder") as tmp:
        head.save_pretrained(tmp, dtype=dtype)
    return Path(out_dir), notes
