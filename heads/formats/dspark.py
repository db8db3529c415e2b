"""DSpark's layout: DeepSeek's released `Qwen3DSparkModel` checkpoints, which vLLM (`method:
dspark`, models/qwen3_dspark.py) loads as they are and llama.cpp's converter turns into its
`dspark` draft GGUF (docs/formats.md "DSpark").

    config.json        DFlash's (heads/formats/dflash.py: the draft layers' Qwen3 fields, block_size,
                       num_target_layers, dflash_config {target_layer_ids, mask_token_id}) with
                       architectures ["Qwen3DSparkModel"] and, at the top level as DeepSeek writes
                       them, target_layer_ids, mask_token_id, markov_rank, markov_head_type
                       "vanilla", enable_confidence_head, confidence_head_with_markov and
                       sample_from_anchor true (every slot drafts: block_size tokens a block)
    model.safetensors  DFlash's tensors plus markov_head.markov_w1.weight [V, r],
                       markov_head.markov_w2.weight [V, r] and, with the confidence head,
                       confidence_head.proj.weight [1, H (+ r)] and .bias [1]; no embed_tokens and
                       no lm_head: the engines take the target's (DeepSeek's files carry copies,
                       which the import checks against the target and drops)

A reduced draft vocabulary (speculators' d2t / t2d) and the gated and rnn Markov heads are
refused on import: drafthead's DSpark drafts over the target's whole vocabulary with the vanilla head.

speculators writes DSpark too (`speculators_model_type: dspark`, `DSparkDraftModel.save_pretrained`):
the same tensor names, the draft layer's fields under `transformer_layer_config`, and
`aux_hidden_state_layer_ids`, which count as ours do (the native `target_layer_ids` plus one).
`read_speculators` reads it through the same rules (fixture `speculators-dspark`), and
`to_speculators` writes it (`--format speculators` on a dspark head), as that fixture holds it.
"""

from __future__ import annotations

from ..io import HeadFormatError
from . import dflash
from .common import SPECULATORS_VERSION, Export, ForeignHead, Layout, read_weights

ARCH = "Qwen3DSparkModel"


def is_layout(cfg: dict) -> bool:
    return ARCH in (cfg.get("architectures") or [])


def head_keys(config) -> dict:
    """The DSpark keys both layouts state at their top level: the mask token and the two heads."""
    return {
        "mask_token_id": config.mask_token_id,
        "markov_rank": config.markov_rank,
        "markov_head_type": "vanilla",
        "enable_confidence_head": config.confidence_head,
        "confidence_head_with_markov": config.confidence_with_markov,
        "sample_from_anchor": True,
    }  # every slot drafts


def to_engine(config, meta: dict, state: dict) -> tuple[dict, dict]:
    cfg, tensors = dflash.to_engine(config, meta, state)
    cfg.update({"architectures": [ARCH], "target_layer_ids": cfg["dflash_config"]["target_layer_ids"], **head_keys(config)})
    return cfg, tensors


def to_speculators(config, meta: dict, state: dict, verifier: str | None = None, verifier_architectures: list | None = None) -> tuple[dict, dict]:
    """speculators' DSpark layout: its config keys (as DSparkDraftModel.save_pretrained writes
    them, fixture `speculators-dspark`) over the native tensors; no embedding, LM head or d2t / t2d
    (a full vocabulary: speculators reads them from the verifier)."""

    native, tensors = to_engine(config, meta, state)
    layer = {k: v for k, v in native.items() if k in dflash.QWEN3_FIELDS or k in ("rope_theta", "rope_scaling")}
    layer.update(
        {
            "model_type": "qwen3",
            "layer_types": native["layer_types"],
            "tie_word_embeddings": False,
            "use_sliding_window": False,
            "sliding_window": None,
        }
    )
    target = config.target
    cfg = {
        "architectures": ["DSparkDraftModel"],
        "speculators_model_type": "dspark",
        "speculators_version": SPECULATORS_VERSION,
        "speculators_config": {
            "algorithm": "dspark",
            "proposal_methods": [
                {"proposal_type": "greedy", "speculative_tokens": config.block_size, "accept_tolerance": 0.0, "verifier_accept_k": 1}
            ],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier or target.name, "architectures": list(verifier_architectures or [])},
        },
        "transformer_layer_config": layer,
        "aux_hidden_state_layer_ids": list(config.feature_layers),  # speculators counts as we do
        "block_size": config.block_size,
        "draft_vocab_size": config.vocab_size,
        **head_keys(config),
        "sliding_window_non_causal": False,
        "target_hidden_size": None,
        "tie_word_embeddings": False,
    }
    return cfg, tensors


def read(src, cfg: dict, state: dict) -> ForeignHead:
    if cfg.get("markov_head_type", "vanilla") != "vanilla":
        raise HeadFormatError(
            f"{src}: markov_head_type {cfg['markov_head_type']!r}: drafthead's DSpark runs the vanilla Markov head only (as vLLM and llama.cpp serve)"
        )
    if cfg.get("sample_from_anchor") is False or cfg.get("dspark_bonus_anchor"):
        raise HeadFormatError(
            f"{src}: sample_from_anchor false: a block whose pending slot drafts nothing is "
            "DFlash's layout with a Markov head, which drafthead does not run"
        )
    draft_vocab = cfg.get("draft_vocab_size")
    if "d2t" in state or (draft_vocab is not None and draft_vocab != cfg.get("vocab_size")):
        raise HeadFormatError(
            f"{src}: a reduced draft vocabulary (draft_vocab_size {draft_vocab}, d2t): drafthead's DSpark drafts over the target's whole vocabulary"
        )
    rank = cfg.get("markov_rank")
    if rank is None:
        raise HeadFormatError(f"{src}: config.json states no markov_rank")
    dcfg = dict(cfg.get("dflash_config") or {})
    for key in ("target_layer_ids", "mask_token_id"):  # DeepSeek writes them at the top level
        if key not in dcfg and cfg.get(key) is not None:
            dcfg[key] = cfg[key]
    copies = {k: state.pop(k) for k in ("embed_tokens.weight", "lm_head.weight", "model.embed_tokens.weight") if k in state}
    state.pop("t2d", None)
    foreign = dflash.read(src, {**cfg, "dflash_config": dcfg}, state)
    confidence = bool(cfg.get("enable_confidence_head", any(k.startswith("confidence_head.") for k in foreign.state)))
    overrides = {
        **foreign.overrides,
        "markov_rank": int(rank),
        "confidence_head": confidence,
        "confidence_with_markov": bool(cfg.get("confidence_head_with_markov", True)),
    }
    if not confidence:
        overrides["confidence_weight"] = 0.0
    notes = foreign.notes + ([f"{', '.join(sorted(copies))}: copies of the target's, checked and dropped"] if copies else [])
    return ForeignHead(
        "dspark",
        "dspark",
        overrides,
        foreign.state,
        target_copies={k.removeprefix("model."): v for k, v in copies.items()},
        notes=notes,
        layer_fields=foreign.layer_fields,
    )


def read_speculators(src, cfg: dict, state: dict) -> ForeignHead:
    """speculators' DSpark layout (module docstring) read as the native one."""
    layer = cfg.get("transformer_layer_config")
    ids = cfg.get("aux_hidden_state_layer_ids")
    if not isinstance(layer, dict) or ids is None:
        raise HeadFormatError(f"{src}: a speculators dspark config needs transformer_layer_config and aux_hidden_state_layer_ids")
    if cfg.get("sliding_window_non_causal"):
        raise HeadFormatError(f"{src}: sliding_window_non_causal: drafthead's DSpark attends the whole context")
    native = {
        **layer,
        "architectures": [ARCH],
        "target_layer_ids": [int(i) - 1 for i in ids],
        **{
            k: cfg[k]
            for k in (
                "mask_token_id",
                "block_size",
                "markov_rank",
                "markov_head_type",
                "draft_vocab_size",
                "enable_confidence_head",
                "confidence_head_with_markov",
                "sample_from_anchor",
            )
            if k in cfg
        },
    }
    foreign = read(src, native, state)
    foreign.layout = "speculators"
    return foreign


def _write_speculators(job) -> tuple[dict, dict]:
    architectures = None if job.target_model is None else getattr(job.target_model.config, "architectures", None)
    return to_speculators(job.config, job.meta, job.state, job.verifier, architectures)


# speculators' DSpark layout is detected as speculators' (heads/formats/speculators.py reads it here)
LAYOUTS = (Layout("dspark", lambda src, cfg: is_layout(cfg), lambda cfg: "dspark", lambda src, cfg, convention: read(src, cfg, read_weights(src))),)
EXPORTS = (
    Export("dspark", ("dspark",), "vLLM's and llama.cpp's DSpark", lambda job: to_engine(job.config, job.meta, job.state)),
    Export("speculators", ("dspark",), "speculators", _write_speculators),
)
