"""`drafthead train --plan TARGET_CONFIG`: per-rank memory of a run for targets the machine at hand
cannot hold, with the target and the head built on the meta device (shapes, no weights).

Per rank, for N ranks (docs/scaling.md has the model and what was run versus only planned):

    params      trainable head parameters, fp32 masters             DDP: all      FSDP: 1/N
    grads       their gradients, fp32                               DDP: all      FSDP: 1/N
    optimizer   AdamW's two moments, fp32                           DDP: all      FSDP: 1/N
    target      the frozen target at its dtype                      DDP: all      FSDP: decoder
                layers 1/N, embedding, final norm and LM head whole (what train/loop/sharding.py shards)
    gathered    FSDP only: the largest unsharded unit during its forward (one target decoder layer,
                or the whole head, whichever is larger), the transient all-gather buffer
    activations what the backward keeps for one micro-batch (batch_size x max_length tokens; a
                rank's 1/N of the columns under context_parallel N, plus the whole rows' keys and
                values each TTT step all-gathers, [T, kv_heads x head_dim] twice per step in fp32),
                plus the chunks it works in:
                  EAGLE (per token, per training-time-test step): the draft layer's saved tensors
                  with its MLP recomputed (heads/eagle3.py) and the gradients that pass through
                  the backward, 55 H bytes in fp32, fitted to the SmolLM2 runs of docs/scaling.md
                  "Long conversations" (what the backward keeps, measured with saved-tensor hooks,
                  is 51 H; the 16K run's step, its heap unfragmented, 55 H); plus the fused
                  features (6 H bytes, once). The loss and the attention run in chunks whose
                  tensors are not kept (heads/losses.py, heads/ttt_attention.py): one chunk at a
                  time, the larger budget of the two;
                  MLP heads (Medusa, Hydra; per token, per head): a residual block (4 H bytes)
                  and the logits (8 V).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch

from ...heads.config import head_kind
from .config import ConfigError, TrainConfig, data_replicas

GIB = 2**30
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class RunShapes:
    """What the memory model needs, read off the meta-device target and head."""

    target_bytes: int
    largest_layer_bytes: int  # one target decoder layer at the target's dtype
    layers_bytes: int  # all decoder layers: the part of the target FSDP shards
    head_trainable: int  # parameters
    head_frozen_bytes: int  # frozen head tensors the head owns (none for ours: they bind the target's)
    hidden: int
    draft_vocab: int
    steps: int  # EAGLE: training-time-test steps; MLP heads (Medusa, Hydra): heads
    kind: str
    tokens: int  # per micro-batch and rank: batch_size x max_length, / context_parallel when rows are split
    gathered_keys: int = 0  # split rows: the whole rows' step-0 keys and values one step gathers (elements)


def run_shapes(config: TrainConfig, target_config: str | Path) -> RunShapes:
    """Build the target from its config.json and this run's head on the meta device."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig

    from ...heads.config import Eagle3Config, MedusaConfig
    from ...heads.eagle3 import Eagle3Head
    from ...heads.registry import _new_module
    from ...ground.target.load import model_auto_class
    from .run import head_config_for
    from .sharding import decoder_layers

    hf_config = AutoConfig.from_pretrained(str(target_config))
    dtype = DTYPES.get(config.target_dtype, torch.bfloat16)  # auto: the GPUs planned for run bf16 natively
    with init_empty_weights():
        target = model_auto_class(hf_config).from_config(hf_config, dtype=dtype)
    target.requires_grad_(False)
    name = Path(target_config).stem
    hcfg = head_config_for(config, target, None, name)
    vocab = hf_config.get_text_config().vocab_size
    # accelerate's init_empty_weights: parameters on the meta device, small buffers (the draft
    # vocabulary's maps) computed for real; the head as built, not initialised from the target
    with init_empty_weights():
        head = _new_module(hcfg, target)
    layers = decoder_layers(target)  # a multimodal target's are its language model's
    layer_bytes = max((sum(p.numel() * p.element_size() for p in layer.parameters()) for layer in layers), default=0)
    kind = head_kind(hcfg.kind)
    return RunShapes(
        target_bytes=sum(p.numel() * p.element_size() for p in target.parameters()),
        largest_layer_bytes=layer_bytes,
        layers_bytes=sum(p.numel() * p.element_size() for layer in layers for p in layer.parameters()),
        head_trainable=sum(p.numel() for p in head.parameters() if p.requires_grad),
        head_frozen_bytes=sum(p.numel() * p.element_size() for p in head.parameters() if not p.requires_grad),
        hidden=hf_config.get_text_config().hidden_size,
        draft_vocab=cast(Eagle3Config, hcfg).draft_vocab_size if kind.draft_vocab else vocab,
        steps=cast(MedusaConfig, hcfg).num_heads if kind.mlp_heads else getattr(hcfg, "ttt_steps", 1),
        kind=hcfg.kind,
        tokens=config.batch_size * -(-config.data.max_length // config.context_parallel),  # a rank's columns
        gathered_keys=(
            2 * config.batch_size * config.data.max_length * head.midlayer.self_attn.k_proj.out_features
            if config.context_parallel > 1 and isinstance(head, Eagle3Head)
            else 0
        ),
    )


EAGLE_STEP_BYTES_PER_H = 55  # per token and TTT step, in units of H (module docstring)


def activation_bytes(shapes: RunShapes) -> int:
    """The estimate in the module docstring, for one micro-batch."""
    from ...heads.losses import LOSS_CHUNK_BYTES
    from ...heads.ttt_attention import CHUNK_BYTES

    h, v = shapes.hidden, shapes.draft_vocab
    if head_kind(shapes.kind).mlp_heads:
        return shapes.tokens * shapes.steps * (4 * h + 8 * v)
    per_token = shapes.steps * EAGLE_STEP_BYTES_PER_H * h + 6 * h
    # one chunk at a time: the loss's, or an attention chunk's scores with their softmax and mask;
    # split rows keep each step's gathered keys and values (fp32) for the backward
    return shapes.tokens * per_token + max(LOSS_CHUNK_BYTES, 3 * CHUNK_BYTES) + 4 * shapes.steps * shapes.gathered_keys


def memory_per_rank(shapes: RunShapes, strategy: str, ranks: int) -> dict[str, int]:
    """Bytes per rank by part (module docstring) for "ddp" or "fsdp" over `ranks` ranks."""
    if strategy not in ("ddp", "fsdp") or ranks < 1:
        raise ValueError(f"strategy ddp|fsdp and ranks >= 1; got {strategy!r}, {ranks}")
    share = ranks if strategy == "fsdp" else 1
    p = shapes.head_trainable
    parts = {
        "params": 4 * p // share,
        "grads": 4 * p // share,
        "optimizer": 8 * p // share,
        "target": shapes.target_bytes - shapes.layers_bytes + shapes.layers_bytes // share + shapes.head_frozen_bytes // share,
        "gathered": max(shapes.largest_layer_bytes, 4 * p) if strategy == "fsdp" and ranks > 1 else 0,
        "activations": activation_bytes(shapes),
    }
    parts["total"] = sum(parts.values())
    return parts


REPLICAS = (1, 8, 64)  # data-parallel replicas planned by default, each of context_parallel ranks


def plan_table(config: TrainConfig, target_config: str | Path, ranks: tuple[int, ...] | None = None) -> str:
    """The printed plan: one row per (strategy, ranks), GiB per rank. ranks: the process counts,
    each a multiple of context_parallel as training needs (default: REPLICAS of them)."""
    ranks = ranks or tuple(n * config.context_parallel for n in REPLICAS)
    for n in ranks:
        try:
            data_replicas(n, config.context_parallel)
        except ConfigError as e:
            raise ConfigError(f"--ranks {n}: {e}, as training would refuse") from None
    shapes = run_shapes(config, target_config)
    head = f"{shapes.kind} head: {shapes.head_trainable / 1e6:.1f}M trainable parameters"
    lines = [
        f"plan for {Path(target_config).stem} ({shapes.target_bytes / GIB:.1f} GiB at {config.target_dtype}), {head}, "
        f"micro-batch {config.batch_size} x {config.data.max_length} tokens"
        + (f" split across {config.context_parallel} ranks" if config.context_parallel > 1 else "")
        + f", {shapes.steps} "
        f"{'heads' if head_kind(shapes.kind).mlp_heads else 'TTT steps'}; GiB per rank:",
        "",
        "| strategy | ranks | params | grads | optimizer | target | gathered | activations | total |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for strategy in ("ddp", "fsdp"):
        for n in ranks:
            m = memory_per_rank(shapes, strategy, n)
            cells = " | ".join(f"{m[k] / GIB:.2f}" for k in ("params", "grads", "optimizer", "target", "gathered", "activations", "total"))
            lines.append(f"| {strategy} | {n} | {cells} |")
    return "\n".join(lines)
