"""Medusa-2's LoRA on the target (peft): which Linears it adapts, in every family.

A name in `lora.target_modules` stands for a job in the decoder layer (the query projection, the
MLP's gate...). Families that fuse or factor those projections name them otherwise, so a name
that no Linear of the target carries falls back to the Linears doing its job there
(`EQUIVALENTS`; docs/families.md "Medusa-2's LoRA"):

    q_proj, k_proj, v_proj   Phi-3: qkv_proj (one fused Linear)
    q_proj                   MLA (DeepSeek-V3, Kimi K2): q_a_proj, q_b_proj (low-rank query)
    k_proj, v_proj           MLA: kv_a_proj_with_mqa, kv_b_proj (joint low-rank keys and values)
    gate_proj, up_proj       Phi-3: gate_up_proj
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, cast

from torch import nn

if TYPE_CHECKING:
    from transformers import PretrainedConfig

EQUIVALENTS = {
    "q_proj": ("qkv_proj", "q_a_proj", "q_b_proj"),
    "k_proj": ("qkv_proj", "kv_a_proj_with_mqa", "kv_b_proj"),
    "v_proj": ("qkv_proj", "kv_a_proj_with_mqa", "kv_b_proj"),
    "gate_proj": ("gate_up_proj",),
    "up_proj": ("gate_up_proj",),
}

log = logging.getLogger(__name__)


def wrap_lora(target: nn.Module, lora) -> nn.Module:
    """The target with trainable LoRA adapters (peft) on `lora_targets`; base weights stay frozen."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    modules = lora_targets(target, lora.target_modules)
    cfg = PeftLoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=modules, bias="none")
    if cfg.lora_dropout and _peft_targets_expert_parameters(cfg, target):
        # peft adapts fused experts through a parameter wrapper, which takes no dropout
        log.warning("LoRA: %s's MoE experts are adapted as fused parameters, which take no dropout: lora dropout 0", _model_type(target))
        cfg.lora_dropout = 0.0
    return get_peft_model(target, cfg)


def _peft_targets_expert_parameters(cfg, model: nn.Module) -> bool:
    """Whether peft will turn some of `cfg`'s module names into fused MoE expert parameters. peft
    maps the transformers 4 names of MoE layers (`gate_proj`, `up_proj`, `down_proj` of
    Qwen2-MoE-like models such as DeepSeek-V3) onto transformers 5's fused 3-D expert tensors
    before it injects (docs/families.md); run that mapping on a copy to see."""
    import copy

    try:
        from peft.utils.transformers_weight_conversion import convert_peft_config_for_transformers
    except ImportError:  # a peft without the mapping adapts modules only
        return False
    probe = copy.deepcopy(cfg)
    convert_peft_config_for_transformers(probe, model, None)
    return bool(getattr(probe, "target_parameters", None))


def resolve_names(present: set[str], names) -> dict[str, tuple[str, ...]]:
    """{requested name: the Linear names that carry its job in this target}: the name itself when
    some Linear carries it, else its EQUIVALENTS that do (empty when none does)."""
    return {name: (name,) if name in present else tuple(n for n in EQUIVALENTS.get(name, ()) if n in present) for name in names}


def lora_targets(model: nn.Module, names) -> list[str]:
    """Full names of the nn.Linear modules that `names` resolve to (resolve_names). LoRA adapts
    linears only: MoE experts that transformers holds as one 3-D parameter per projection
    (Qwen3-MoE, DeepSeek-V3) carry the same names (`experts.down_proj`), and peft would wrap them
    as parameters, which refuses dropout; they stay frozen (docs/families.md). A name that
    resolves to no Linear is logged."""
    linears = {name: name.rsplit(".", 1)[-1] for name, module in model.named_modules() if isinstance(module, nn.Linear)}
    resolved = resolve_names(set(linears.values()), names)
    wanted = {n for carried in resolved.values() for n in carried}
    found = [name for name, short in linears.items() if short in wanted]
    if not found:
        raise ValueError(
            f"lora.target_modules {sorted(names)} name no Linear of this target; its Linears: {', '.join(sorted(set(linears.values())))}"
        )
    for name, carried in resolved.items():
        if not carried:
            log.warning("LoRA: no Linear of this %s target does the job of %s: not adapted", _model_type(model), name)
        elif carried != (name,):
            log.info("LoRA: %s is %s in this %s target", name, " + ".join(carried), _model_type(model))
    return found


def _model_type(model: nn.Module) -> str:
    """The transformers model_type of a target (a PreTrainedModel, which nn.Module does not type)."""
    return cast("PretrainedConfig", model.config).model_type
