"""How a checkpoint written by another package is compared with ours, shared by
tests/test_interop_fixtures.py and `make interop` (scripts/interop/run.py), so both apply one set
of rules. The inputs are tests/fixtures/interop/inputs.safetensors."""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from drafthead.heads.formats.common import WEIGHT_FILES, read_weights

# the checkpoints other packages wrote, each in its folder (tests/fixtures/interop/README.md)
FIXTURES = Path(__file__).parent / "fixtures" / "interop"


def our_outputs(head, inputs: dict) -> dict[str, torch.Tensor]:
    """Our head on the shared inputs: column t pairs the token at t + 1 with the feature of t, at
    position t, causal. EAGLE-3: fused [1, T, H], hidden, draft-vocab logits; EAGLE-1: hidden;
    Medusa: logits [K, 1, T, V]."""
    ids = inputs["input_ids"]
    pos = torch.arange(ids.shape[1])[None]
    with torch.no_grad():
        if head.kind in ("eagle3", "eagle31"):
            fused = head.fuse(list(inputs["features3"].chunk(3, dim=-1)))  # cat order = aux-layer order
            hidden, logits = head.step(fused, ids, pos)
            return {"fused": fused, "hidden": hidden, "logits": logits}
        if head.kind == "eagle1":
            return {"hidden": head.step(head.fuse(inputs["feature"]), ids, pos)[0]}
        return {"logits": head(inputs["hidden"])}


def reference_as_ours(head, reference: dict) -> dict:
    """References hold the layer output; with norm_output our step returns what the next step
    reads, its norm."""
    if head.kind in ("eagle3", "eagle31") and head.config.norm_output:
        with torch.no_grad():
            reference = {**reference, "hidden": head.norm(reference["hidden"])}
    return reference


def target_as_producer_saw(target, folder: Path):
    """The target with its embedding rounded as the producer's own forward saw it: a checkpoint's
    copy below float32 (SpecForge to_hf stores bf16) is what that forward embedded with, while the
    import checks the copy against the target and reads the target's."""
    folder = Path(folder)
    has_weights = folder.is_dir() and any((folder / f).is_file() for f in WEIGHT_FILES)
    stored = read_weights(folder).get("embed_tokens.weight") if has_weights else None
    if stored is None or stored.dtype == torch.float32:
        return target
    rounded = copy.deepcopy(target)
    with torch.no_grad():
        emb = rounded.get_input_embeddings().weight
        emb.copy_(emb.to(stored.dtype).float())
    return rounded
