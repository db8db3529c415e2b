"""Medusa-2's LoRA adapts the same jobs in every family: the default `lora.target_modules` (the
Llama names) reach Phi-3's fused projections and MLA's low-rank ones (train/loop/lora.py)."""

import copy
import logging

import pytest
from torch import nn

from drafthead.train.loop.config import LoraConfig
from drafthead.train.loop.lora import lora_targets, resolve_names, wrap_lora
from tests.tiny import TARGETS, tiny_causal_lm

DEFAULT = LoraConfig().target_modules


def decoder_linears(model) -> set[str]:
    """Short names of the Linears inside the decoder layers' attention and dense MLPs (routers
    and the LM head excluded): what a LoRA on the attention and the MLP should cover."""
    return {
        name.rsplit(".", 1)[-1]
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and ".layers." in name and not name.endswith((".gate", ".router"))
    }


@pytest.mark.parametrize("family", [f for f in TARGETS if f in ("llama", "phi3", "deepseek_v3", "gemma3", "llama4", "qwen3")])
def test_the_default_names_adapt_every_attention_and_mlp_linear(family):
    """What peft adapts in the end (a lora_A beside the Linear). DeepSeek-V3 is the exception the
    docs name: peft turns its MLP names onto the fused routed experts, and its dense MLP stays."""
    model = tiny_causal_lm(family)
    expected = decoder_linears(model)
    wrapped = wrap_lora(copy.deepcopy(model), LoraConfig())  # peft wraps in place
    adapted = {name.split(".lora_A")[0].rsplit(".", 1)[-1] for name, _ in wrapped.named_parameters() if ".lora_A" in name}
    if family == "deepseek_v3":
        expected -= {"gate_proj", "up_proj", "down_proj"}
        assert {"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj"} <= expected
    assert expected <= adapted, family


def test_a_name_resolves_to_its_own_linear_before_its_equivalents():
    assert resolve_names({"q_proj", "qkv_proj"}, ["q_proj"]) == {"q_proj": ("q_proj",)}
    assert resolve_names({"qkv_proj", "gate_up_proj"}, ["q_proj", "up_proj", "down_proj"]) == {
        "q_proj": ("qkv_proj",),
        "up_proj": ("gate_up_proj",),
        "down_proj": (),
    }
    assert resolve_names({"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj"}, ["q_proj", "v_proj"]) == {
        "q_proj": ("q_a_proj", "q_b_proj"),
        "v_proj": ("kv_a_proj_with_mqa", "kv_b_proj"),
    }


def test_a_name_no_linear_carries_is_logged_and_none_at_all_is_an_error(caplog):
    model = tiny_causal_lm("qwen3_moe")  # its experts are fused 3-D parameters, not Linears
    with caplog.at_level(logging.WARNING, logger="drafthead.train.loop.lora"):
        lora_targets(model, DEFAULT)
    assert "does the job of gate_proj" in caplog.text
    with pytest.raises(ValueError, match="name no Linear"):
        lora_targets(model, ["c_attn"])
