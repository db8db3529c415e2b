"""Row-invariant decoding: a row's logits are the same bits whether the target computes it alone
(plain decoding, one token per forward) or with the other nodes of a tree and other batch rows,
so speculative output equals plain output token for token in bf16 too (docs/acceptance.md
"Row invariance").

A forward's result for one row can depend on the other rows only where a kernel's reduction order
depends on the row count. Two places do in the target's decode forward:

  * the linears: BLAS and oneDNN pick other blockings for other row counts. The panel kernel
    (inference/kernels/panel_kernel.py) sums each output over K in order, in one fp32
    accumulator per row and column, whatever the row count: every linear runs on it here.
  * attention: a fused kernel's query blocking, and the key count (a tree forward holds the
    other nodes' keys, masked). `row_invariant_attention` computes each query row on its own,
    over exactly the keys it may see, in position order, with one fixed sequence of operations
    (inference/kernels/csrc/row_attention.cpp): the same bits as that token's own one-row forward.

The rest is per-row already (norms reduce over a row's own hidden size; RoPE, activations and
residuals are elementwise), which the tests check op by op and for whole forwards.

The prompt's prefill is shared by plain and speculative decoding alike, so it keeps the fused
attention; only verify forwards swap it (TorchTarget.verify). The linears are swapped for the
whole generation (TorchTarget.engine_context), the prefill's included.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from ..kernels import panel_kernel

ATTENTION_NAME = "drafthead_row_invariant"


def visible_keys(mask: torch.Tensor) -> torch.Tensor:
    """A layer's attention mask [B, 1 or heads, Tq, Tk] (additive: 0 where a key is seen; or
    boolean: True) -> bool [B, Tq, Tk], the keys each query row sees (every head alike)."""
    seen = mask if mask.dtype == torch.bool else mask == 0
    return seen[:, 0]


def row_invariant_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    softcap: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query [B, h, Tq, D], key/value [B, hkv, Tk, D]
    -> ([B, Tq, h, Dv], None). Each query row on its own, in fp32, over exactly the keys it sees in
    key order (the row_attention kernel, inference/kernels/csrc/row_attention.cpp)."""
    if kwargs.get("s_aux") is not None or kwargs.get("sinks") is not None:
        raise NotImplementedError("row-invariant attention does not take attention sinks (gpt-oss) yet")
    if attention_mask is None:
        raise ValueError("row-invariant attention needs the engine's tree mask")
    if not panel_kernel.load():
        raise ValueError(f"row-invariant attention needs the CPU kernels, which are unavailable: {panel_kernel.why_unavailable()}")
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    out = torch.ops.drafthead_attention.row_attention(
        query.float(),
        key.float(),
        value.float(),
        visible_keys(attention_mask)[..., : key.shape[2]].contiguous(),
        float(scaling),
        float(softcap or 0.0),
    )
    return out.to(query.dtype), None


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if ATTENTION_NAME not in AttentionInterface._global_mapping:
        AttentionInterface.register(ATTENTION_NAME, row_invariant_attention)
        AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)


def _configs(model: nn.Module) -> list:
    """The model's config and every sub-config that names an attention implementation."""
    found: list = []
    stack: list = [model.config]
    while stack:
        cfg = stack.pop()
        if cfg is None or any(cfg is c for c in found):
            continue
        found.append(cfg)
        stack += [getattr(cfg, name, None) for name in getattr(cfg, "sub_configs", {})]
    return found


@contextlib.contextmanager
def invariant_attention(model: nn.Module):
    """Within the block, every attention layer of `model` runs `row_invariant_attention`."""
    _register()
    configs = _configs(model)
    before = [cfg._attn_implementation for cfg in configs]
    for cfg in configs:
        cfg._attn_implementation = ATTENTION_NAME
    try:
        yield
    finally:
        for cfg, name in zip(configs, before):
            cfg._attn_implementation = name
