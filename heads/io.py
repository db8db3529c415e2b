"""Saving and reading head directories, and the base class every head shares.

A head directory holds:

    config.json        {"format": "drafthead-head", "drafthead_version", "config": {kind, ...,
                        target: TargetIdentity}, "layer_config": the draft decoder layer's HF config
                        (EAGLE heads; lets export run without the target), "dtype"}
    model.safetensors  the head's own tensors only (trainable weights and buffers such as d2t/t2d);
                        frozen references to the target's embedding / LM head are not saved
    adapter/           (medusa2 only) the peft LoRA adapter merged into the target on load

Every file is written to a temporary name and renamed into place, config.json last, so a crash
never leaves a directory whose config points at a half-written weights file.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from .batch import FeatureBatch
from .config import HeadConfig, config_from_dict, head_kind
from ..ground.files import FileFormatError, read_json, read_safetensors, write_json, write_safetensors
from .packing import same_segment_shift
from ..ground.target.parts import input_embeddings, output_embeddings

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
ADAPTER_DIR = "adapter"
FORMAT = "drafthead-head"


class HeadFormatError(FileFormatError):
    """A head directory that cannot be loaded: missing/corrupt files, unknown keys, bad tensors."""


def drafthead_version() -> str:
    """The installed package's version (one home: drafthead/__init__.py, which pyproject.toml
    reads); read from the package metadata, so heads/ imports nothing above it."""
    import importlib.metadata

    try:
        return importlib.metadata.version("drafthead")
    except importlib.metadata.PackageNotFoundError:  # a source tree on sys.path, not installed
        return "unknown"


def read_head_dir(path) -> tuple[HeadConfig, dict, dict[str, torch.Tensor]]:
    """(config, the whole config.json dict, state dict) of a saved head; format errors raise
    `HeadFormatError` (unknown kind / config key included)."""
    path = Path(path)
    if not path.is_dir():
        raise HeadFormatError(f"head directory {path} does not exist")
    meta = _read(read_json, path / CONFIG_NAME)
    if meta.get("format") != FORMAT or "config" not in meta:
        raise HeadFormatError(
            f"{path / CONFIG_NAME} is not a drafthead head config (format={meta.get('format')!r}); "
            "engine layouts are read with heads.export.import_head"
        )
    try:
        config = config_from_dict(meta["config"])
    except ValueError as e:
        raise HeadFormatError(f"{path / CONFIG_NAME}: {e}") from e
    if config.target is None:
        raise HeadFormatError(f"{path / CONFIG_NAME}: config has no target identity")
    state = _read(read_safetensors, path / WEIGHTS_NAME)
    return config, meta, state


def _read(read, path: Path):
    """read(path), a file of a head folder: one it cannot read is the folder's HeadFormatError."""
    try:
        return read(path)
    except HeadFormatError:
        raise
    except FileFormatError as e:
        raise HeadFormatError(str(e)) from e


def check_state_dict(expected: dict[str, torch.Tensor], loaded: dict[str, torch.Tensor], where: str = "") -> None:
    """Every problem at once: missing tensors, unexpected tensors, shape mismatches."""
    problems = []
    missing = sorted(set(expected) - set(loaded))
    unexpected = sorted(set(loaded) - set(expected))
    if missing:
        problems.append(f"missing tensor(s): {', '.join(missing)}")
    if unexpected:
        problems.append(f"unexpected tensor(s): {', '.join(unexpected)}")
    for k in sorted(set(expected) & set(loaded)):
        if tuple(expected[k].shape) != tuple(loaded[k].shape):
            problems.append(f"shape mismatch for {k}: expected {tuple(expected[k].shape)}, file has {tuple(loaded[k].shape)}")
        elif expected[k].dtype.is_floating_point != loaded[k].dtype.is_floating_point:
            problems.append(f"dtype mismatch for {k}: expected {expected[k].dtype}, file has {loaded[k].dtype}")
    if problems:
        raise HeadFormatError(f"weights {where} do not fit the head:\n  " + "\n  ".join(problems))


# ----------------------------------------------------------------------------- the base class


class FrozenRefs:
    """Holds the target's modules a head reads through (input embedding, LM head) without
    registering them: they are neither parameters of the head nor saved with it, and `head.to()`
    leaves them alone (they live wherever the target lives)."""

    def __init__(self) -> None:
        self.embed: nn.Embedding | None = None
        self.lm_head: nn.Linear | None = None

    def embed_tokens(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows of the target's raw embedding table [.., H]. A lookup in the weight, not a call of
        the module: Gemma's module also scales by sqrt(H), which every engine's drafter leaves out
        (it embeds with the table alone; docs/formats.md "The draft layer per target family")."""
        if self.embed is None:
            raise RuntimeError("head is not bound to a target: call head.bind_target(model)")
        with torch.no_grad():  # frozen: no gradient into the target's embedding
            return nn.functional.embedding(ids, self.embed.weight).to(dtype)

    def lm_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Target LM head applied to h [.., H] -> [.., V], differentiable w.r.t. h only."""
        if self.lm_head is None:
            raise RuntimeError("head is not bound to a target: call head.bind_target(model)")
        w = self.lm_head.weight.detach()
        b = None if getattr(self.lm_head, "bias", None) is None else self.lm_head.bias.detach()
        return nn.functional.linear(h.to(w.dtype), w, b).to(h.dtype)


class DraftHeadBase(nn.Module):
    """What every head shares: config, target binding, save/load.

    Subclasses set `self.config`, `self.refs = FrozenRefs()` and implement `compute_loss` plus
    their inference methods; `layer_config()` returns the HF config dict of an internal decoder
    layer (EAGLE) or None.
    """

    config: HeadConfig
    refs: FrozenRefs
    # True: the head builds its draft layers from the target's RoPE decoder layer or its config,
    # so a target without one (GPT-2) cannot have it (heads/registry.py check_target_fits)
    needs_rope_decoder = False

    @property
    def kind(self) -> str:
        return self.config.kind

    def compute_loss(self, batch: FeatureBatch) -> tuple[torch.Tensor, dict[str, float]]:
        """The training loss on `batch` and its metrics; each kind has its own."""
        raise NotImplementedError(f"{type(self).__name__} defines no compute_loss")

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self.config.feature_layers

    @property
    def needs_last_hidden(self) -> bool:
        return self.config.needs_last_hidden

    @property
    def dtype(self) -> torch.dtype:
        return next(p for p in self.parameters() if p.is_floating_point()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    def bind_target(self, model: nn.Module) -> "DraftHeadBase":
        """Point the frozen references at `model`'s input embedding and LM head."""
        self.refs.embed = input_embeddings(model)
        self.refs.lm_head = output_embeddings(model)
        return self

    def layer_config(self) -> dict | None:
        return None

    def init_from_target(self, model: nn.Module, **kwargs) -> None:
        """Initialise owned weights from the target (copies, e.g. Medusa's LM heads)."""

    def save_pretrained(self, path, *, dtype: torch.dtype | None = None, adapter_model=None, state: dict[str, torch.Tensor] | None = None) -> Path:
        """Write config.json + model.safetensors (own tensors only) atomically.

        dtype: cast floating tensors (e.g. torch.bfloat16 halves the file); integer/bool buffers
        (d2t, t2d) keep theirs. adapter_model: a peft model whose adapter goes to `adapter/`.
        state: the tensors to write instead of this module's own (a sharded head's gathered
        state dict, same keys); None: `self.state_dict()`.
        """
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        if state is not None and set(state) != set(self.state_dict()):
            raise ValueError(f"state keys do not match the head's: {sorted(set(state) ^ set(self.state_dict()))[:4]}")
        state = self.state_dict() if state is None else state
        if dtype is not None:
            state = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in state.items()}
        float_dtypes = {str(v.dtype).removeprefix("torch.") for v in state.values() if v.is_floating_point()}
        if adapter_model is not None:
            if not head_kind(self.kind).adapts_target:
                raise ValueError(f"only medusa2 heads carry a target adapter, this is {self.kind}")
            adapter_model.save_pretrained(str(path / ADAPTER_DIR))
        write_safetensors(path / WEIGHTS_NAME, state, {"format": "pt"})
        meta = {
            "format": FORMAT,
            "drafthead_version": drafthead_version(),
            "config": self.config.to_dict(),
            "layer_config": self.layer_config(),
            "dtype": sorted(float_dtypes)[0] if len(float_dtypes) == 1 else sorted(float_dtypes),
        }
        write_json(path / CONFIG_NAME, meta)  # last: the directory is complete once this exists
        return path


# ----------------------------------------------------------------------------- label alignment
# Shared by every head's compute_loss. Kept here, beside the base class, so there is one home for
# the rule that trips every reimplementation (docs/acceptance.md "loss-mask off-by-one").


def shift_left(x: torch.Tensor, n: int, fill=0) -> torch.Tensor:
    """out[:, t] = x[:, t + n] for t + n < T, else `fill`. x: [B, T, ...]."""
    if n == 0:
        return x
    T = x.shape[1]
    out = torch.full_like(x, fill)
    if n < T:
        out[:, : T - n] = x[:, n:]
    return out


def shifted_labels(
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    attention_mask: torch.Tensor,
    shift: int,
    position_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The token `shift` positions ahead of each position, and where it is a valid label.

    A prediction made at position t for token t + shift counts iff t + shift is inside the
    sequence, is a real token (attention_mask) and is an assistant token (loss_mask; the mask
    marks the *label* positions, so it is read at t + shift, not at t). Used as:
      Medusa head k (0-based) at t  -> token t + k + 2  (the LM head itself predicts t + 1)
      EAGLE-1 at t (feature_t, token_{t+1}) -> token t + 2
      EAGLE-3 unroll step i at t    -> token t + 2 + i

    input_ids/loss_mask/attention_mask: [B, T]. position_ids [B, T] of packed rows (heads/packing.py):
    t + shift must also lie in t's conversation. Returns labels [B, T] long (0 where invalid) and
    valid [B, T] bool.
    """
    if shift < 1:
        raise ValueError(f"shift must be >= 1, got {shift}")
    labels = shift_left(input_ids, shift, 0)
    valid = shift_left(loss_mask.bool() & attention_mask.bool(), shift, False)
    inside = same_segment_shift(position_ids, shift)
    return labels, valid if inside is None else valid & inside
