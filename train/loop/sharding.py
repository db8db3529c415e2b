"""FSDP for the trainer: torch's own `fully_shard` (FSDP2), applied by us rather than by accelerate.

Why not `accelerate launch --use_fsdp`: on CPU, accelerate reports FSDP runs as MULTI_CPU and
wraps the model in DDP instead (docs/scaling.md "FSDP"). `fully_shard` works on CPU over gloo and
on CUDA over NCCL alike, so the trainer shards the modules itself whenever
`parallelism: fsdp` is set, on whatever process group accelerate (or torchrun) started.

What is sharded (docs/scaling.md):
  * the head (the HeadLoss wrapper around it): parameters, gradients and AdamW moments, 1/N each;
  * the frozen target's decoder layers, one FSDP unit per layer, so a rank holds 1/N of them and
    gathers one layer at a time during the feature forward. The embedding, final norm and LM head
    stay whole on every rank: heads read them directly (heads/io.py FrozenRefs), outside any
    FSDP forward that would gather them.

Checkpoints are gathered (full, unsharded tensors in the same files as DDP's), so they can be read
by the exporters and by a run on another strategy. The optimizer state is keyed by parameter name
(torch.distributed.checkpoint's full optimizer state dict), not by index.
"""

from __future__ import annotations

from typing import Any, Iterable, cast

import torch
from torch import nn

from ...heads.eagle import decoder_layers as find_decoder_layers


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated decoder blocks of a Hugging Face causal LM (heads.eagle.decoder_layers, the
    one place that finds them); [] when the model has no such list."""
    try:
        return list(find_decoder_layers(model))
    except TypeError:
        return []


def shard_frozen_target(model: nn.Module) -> int:
    """fully_shard each decoder layer of the frozen target. Returns how many layers were sharded.
    Frozen (requires_grad=False) parameters are gathered for the forward and dropped after it."""
    from torch.distributed.fsdp import fully_shard

    layers = decoder_layers(model)
    if not layers:
        raise ValueError(f"{type(model).__name__} has no decoder layer list to shard; set shard_target: false")
    for layer in layers:
        fully_shard(layer)
    return len(layers)


def shard_trainable(module: nn.Module) -> nn.Module:
    """fully_shard the module whose forward is the loss (one FSDP unit: heads are a few layers)."""
    from torch.distributed.fsdp import fully_shard

    fully_shard(module)
    return module


def local_numel(params: Iterable[torch.Tensor]) -> int:
    """Elements this rank stores: a DTensor's local shard, a plain tensor whole."""
    from torch.distributed.tensor import DTensor

    return sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in params)


def clip_grad_norm(params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """torch's clip_grad_norm_ over sharded gradients; the norm comes back as a plain tensor of the
    whole (all ranks') gradient, as under DDP."""
    from torch.distributed.tensor import DTensor

    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def _options(**kwargs):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kwargs)


def gathered_weights(module: nn.Module) -> dict[str, torch.Tensor]:
    """The module's state dict, unsharded, on CPU. A collective: every rank must call it."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return cast(dict[str, torch.Tensor], get_model_state_dict(module, options=_options(cpu_offload=True)))  # a model's state: tensors


def gathered_state(module: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    """(weights, optimizer state), unsharded, on CPU. A collective: every rank must call it."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return gathered_weights(module), get_optimizer_state_dict(module, optimizer, options=_options(cpu_offload=True))


def load_gathered_state(module: nn.Module, optimizer: torch.optim.Optimizer, weights: dict[str, torch.Tensor], optim: dict) -> None:
    """The inverse of `gathered_state`: every rank passes the full tensors and keeps its shard."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    set_model_state_dict(module, cast(dict[str, Any], weights), options=_options())  # typed for any state dict value
    set_optimizer_state_dict(module, optimizer, optim, options=_options())
