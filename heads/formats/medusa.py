"""Medusa layouts (docs/formats.md, "Medusa").

Upstream Medusa (medusa-llm), also loaded by vLLM 0.32 (which remaps these keys; vLLM 0.33 dropped its
Medusa loader, and SGLang has none):
    config.json        medusa_num_heads, medusa_num_layers, base_model_name_or_path
    medusa_lm_head.pt  torch state dict: `{h}.{l}.linear.weight|bias` (ResBlock l of head h) and
                       `{h}.{L}.weight` (head h's LM head, L = medusa_num_layers); its blocks are one module repeated, so
                       the L blocks of a head share weights
Old vLLM Medusa layout (read only; no current engine loads it): config `model_type: medusa`,
`num_heads`, `num_hidden_layers`; keys `blocks.{h}.layers.{l}.weight|bias`, `lm_heads.{h}.weight`
(our own names), `original_lm_head: true` when every head shares one LM head.
"""

from __future__ import annotations

import re

import torch

from ..io import HeadFormatError
from .common import Export, ForeignHead, Layout, read_weights
from ...ground.target.parts import lm_head_of

UPSTREAM_WEIGHTS = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")
_UPSTREAM_KEY = re.compile(r"^(\d+)\.(\d+)\.(linear\.weight|linear\.bias|weight)$")


def is_upstream(cfg: dict) -> bool:
    return "medusa_num_heads" in cfg


def is_vllm(cfg: dict) -> bool:
    return cfg.get("model_type") == "medusa" or "MedusaModel" in (cfg.get("architectures") or [])


def to_upstream(config, meta: dict, state: dict, target_lm_head: torch.Tensor | None, base_name: str) -> tuple[dict, dict]:
    K, L = config.num_heads, config.num_layers
    for h in range(K):  # upstream builds a head's blocks as `[ResBlock(H)] * L`: one module L times
        blocks = [(state[f"blocks.{h}.layers.{j}.weight"], state[f"blocks.{h}.layers.{j}.bias"]) for j in range(L)]
        if any(not (torch.equal(w, blocks[0][0]) and torch.equal(b, blocks[0][1])) for w, b in blocks[1:]):
            raise ValueError(
                f"upstream Medusa shares one residual block's weights across a head's {L} blocks; this "
                f"head's blocks differ (head {h}), so it would run differently there: use num_layers=1"
            )
    out = {}
    for h in range(K):
        for j in range(L):
            out[f"{h}.{j}.linear.weight"] = state[f"blocks.{h}.layers.{j}.weight"]
            out[f"{h}.{j}.linear.bias"] = state[f"blocks.{h}.layers.{j}.bias"]
        if config.share_lm_head:
            if target_lm_head is None:
                raise ValueError("this Medusa head reads the target's LM head, which upstream Medusa stores in every head: pass the target")
            out[f"{h}.{L}.weight"] = target_lm_head.detach().to("cpu", out[f"{h}.0.linear.weight"].dtype)
        else:
            out[f"{h}.{L}.weight"] = state[f"lm_heads.{h}.weight"]
    # hidden_size / vocab_size / medusa_fc_bias: vLLM 0.32 also loads this layout (it remaps the keys)
    # and would otherwise assume hidden 4096 and drop the biases silently
    cfg = {
        "medusa_num_heads": K,
        "medusa_num_layers": L,
        "base_model_name_or_path": base_name,
        "hidden_size": config.hidden_size,
        "vocab_size": config.vocab_size,
        "medusa_fc_bias": True,
    }
    return cfg, out


def read_upstream(src, cfg: dict, state: dict) -> ForeignHead:
    K, L = int(cfg["medusa_num_heads"]), int(cfg.get("medusa_num_layers", 1))
    ours = {}
    for key, value in state.items():
        m = _UPSTREAM_KEY.match(key)
        if m is None:
            raise HeadFormatError(f"{src}: unexpected tensor {key} in a Medusa checkpoint")
        h, j, what = int(m.group(1)), int(m.group(2)), m.group(3)
        if h >= K:
            raise HeadFormatError(f"{src}: tensor {key} names head {h}, but medusa_num_heads is {K}")
        if what == "weight":
            if j != L:
                raise HeadFormatError(f"{src}: tensor {key}: head {h}'s LM head should sit at index {L}")
            ours[f"lm_heads.{h}.weight"] = value
        else:
            if j >= L:
                raise HeadFormatError(f"{src}: tensor {key} names block {j}, but medusa_num_layers is {L}")
            ours[f"blocks.{h}.layers.{j}.{what.split('.')[1]}"] = value
    overrides = {"num_heads": K, "num_layers": L, "share_lm_head": False}
    return ForeignHead("medusa", "medusa1", overrides, ours)


def read_vllm(src, cfg: dict, state: dict) -> ForeignHead:
    shared = bool(cfg.get("original_lm_head", False))
    state = dict(state)
    copies = {}
    if shared and "lm_heads.0.weight" in state:
        copies["lm_head.weight"] = state.pop("lm_heads.0.weight")  # must equal the target's own LM head
    overrides = {"num_heads": int(cfg["num_heads"]), "num_layers": int(cfg["num_hidden_layers"]), "share_lm_head": shared}
    return ForeignHead("medusa-vllm", "medusa1", overrides, state, copies)


def _write(job) -> tuple[dict, dict]:
    return to_upstream(job.config, job.meta, job.state, job.target_tensor(lm_head_of), job.config.target.name)


LAYOUTS = (
    Layout(
        "medusa",
        lambda src, cfg: is_upstream(cfg) or any((src / n).is_file() for n in UPSTREAM_WEIGHTS),
        lambda cfg: "medusa1",
        lambda src, cfg, convention: read_upstream(src, cfg, read_weights(src, UPSTREAM_WEIGHTS)),
    ),
    Layout("medusa-vllm", lambda src, cfg: is_vllm(cfg), lambda cfg: "medusa1", lambda src, cfg, convention: read_vllm(src, cfg, read_weights(src))),
)
EXPORTS = (Export("medusa", ("medusa1",), "upstream Medusa", _write, weights="medusa_lm_head.pt", served_layer=False),)
