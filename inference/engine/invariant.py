"""Row-invariant decoding: a row's logits are the same bits whether the target computes it alone
(plain decoding, one token per forward) or with the other nodes of a tree and other batch rows,
so speculative output equals plain output token for token in bf16 too (docs/acceptance.md
"Row invariance").

A forward's result for one row can depend on the other rows only where a kernel's reduction order
depends on the row count. Two places do in the target's decode forward:

  * the linears: BLAS and oneDNN pick other blockings for other row counts. The row-invariant
    linears (inference/kernels/invariant_linear.py: AMX tiles, vdpbf16ps or the panel kernel,
    by what the CPU has) sum each output over K in one fixed order whatever the row count:
    every linear runs on them here.
  * attention: a fused kernel's query blocking, and the key count (a tree forward holds the
    other nodes' keys, masked). `row_invariant_attention` computes each query row on its own,
    over exactly the keys it may see, in position order, with one fixed sequence of operations
    (inference/kernels/csrc/row_attention.cpp): the same bits as that token's own one-row forward.

The rest is per-row already (norms reduce over a row's own hidden size; RoPE, activations and
residuals are elementwise), which the tests check op by op and for whole forwards.

Every forward of the generation runs these kernels, the prompt's prefill included (the linears
through TorchTarget.engine_context, the attention through TorchTarget's forwards): a prompt
token's K/V are then the bits its own one-token forward gives, whatever the prompt's length, the
padding of a batch or the rows that joined with it, so plain and speculative decoding start from
the same cache and cannot part at position 0.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from ..kernels import invariant_linear, panel_kernel
from ..kernels.target_linears import fits_in_memory, physical_memory_bytes

ATTENTION_NAME = "drafthead_row_invariant"


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
    -> ([B, Tq, h, Dv], None) in query's dtype (fp32 or bf16). Each query row on its own, in fp32,
    over exactly the keys it sees in key order (the row_attention kernel,
    inference/kernels/csrc/row_attention.cpp)."""
    if kwargs.get("s_aux") is not None or kwargs.get("sinks") is not None:
        raise NotImplementedError("row-invariant attention does not take attention sinks (gpt-oss) yet")
    if kwargs.get("position_bias") is not None:
        raise NotImplementedError("row-invariant attention does not take a position bias")
    if attention_mask is None:  # the text layers always get one (explicit_mask); an encoder's (vision) may not
        attention_mask = unmasked(module, query.shape[0], query.shape[2], key.shape[2], kwargs.get("is_causal"))
    if not panel_kernel.load():
        raise ValueError(f"row-invariant attention needs the CPU kernels, which are unavailable: {panel_kernel.why_unavailable()}")
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    # the mask as the layer has it: [B, 1 or h, Tq, >= Tk], boolean or additive, read in place
    out = torch.ops.drafthead_attention.row_attention(query, key, value, attention_mask, float(scaling), float(softcap or 0.0))
    return out, None


def unmasked(module: nn.Module, batch: int, queries: int, keys: int, is_causal: bool | None) -> torch.Tensor:
    """The keys SDPA lets each query see when a layer passes no mask: causal (query i sees keys <=
    i) where the layer is causal and has more than one query, else every key. bool [B, 1, Tq, Tk]."""
    causal = (is_causal if is_causal is not None else getattr(module, "is_causal", True)) and queries > 1
    seen = torch.ones(queries, keys, dtype=torch.bool)
    return (seen.tril() if causal else seen).expand(batch, 1, queries, keys)


def on_by_default(model: nn.Module) -> bool:
    """Whether a transformers model decodes row-invariantly when nobody chose (GenerationConfig
    .row_invariant None, neither --row-invariant nor --no-row-invariant): in bf16 on a CPU with a
    native bf16 row-invariant path (AMX or avx512_bf16, inference/kernels/invariant_linear.py),
    where a verify forward costs about what the fastest kernels' does (docs/acceptance.md "Row
    invariance"). fp32 keeps the fastest kernels: its near-ties have not been seen to flip. Not
    for attention sinks, which the row attention does not take, nor where the kernels' copy of
    the linear weights would not fit in memory beside the model."""
    param = next(model.parameters(), None)
    if param is None or param.device.type != "cpu" or param.dtype != torch.bfloat16 or has_attention_sinks(model):
        return False
    linear_bytes = sum(m.weight.numel() * m.weight.element_size() for m in model.modules() if type(m) is nn.Linear)
    if not fits_in_memory(linear_bytes, physical_memory_bytes()):
        return False
    try:
        return invariant_linear.path_for(torch.bfloat16) in invariant_linear.BF16_ONLY
    except ValueError:  # no kernels here, or DRAFTHEAD_INVARIANT_PATH names one this CPU lacks
        return False


def has_attention_sinks(model: nn.Module) -> bool:
    """Whether an attention layer of `model` holds sinks (gpt-oss: a learned logit per head that
    joins every softmax)."""
    return any(isinstance(getattr(m, "sinks", None), torch.Tensor) for m in model.modules())


def explicit_mask(*args, **kwargs) -> torch.Tensor | None:
    """transformers' SDPA mask, never skipped: a prefill with no padding gets its causal mask
    too, which `row_invariant_attention` reads (SDPA would take `is_causal` instead)."""
    from transformers.masking_utils import sdpa_mask

    kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(*args, **kwargs)


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    if ATTENTION_NAME not in AttentionInterface._global_mapping:
        AttentionInterface.register(ATTENTION_NAME, row_invariant_attention)
        AttentionMaskInterface.register(ATTENTION_NAME, explicit_mask)


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
