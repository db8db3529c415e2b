"""A tiny target that answers at length, for the server tests (tests/test_serve.py,
tests/test_adapt.py): `data tiny-target`'s folder with its blank tokens (EOS, newlines, spaces)
given zero embeddings, tied to the LM head, so their logits are 0 and greedy answers run their
whole length with text (the random model otherwise often answers EOS or blank lines at once)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def answering_tiny_target(out: Path, seed: int = 5) -> Path:
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    subprocess.run(
        [sys.executable, "-m", "drafthead", "data", "tiny-target", "--out", str(out), "--seed", str(seed)], check=True, capture_output=True
    )
    tokenizer = AutoTokenizer.from_pretrained(out)
    blank = [i for i in range(len(tokenizer)) if not tokenizer.decode([i], skip_special_tokens=True).strip()]
    weights = load_file(out / "model.safetensors")
    weights["model.embed_tokens.weight"][blank] = 0.0
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out


def random_eagle3_head(target: Path, out: Path) -> Path:
    """An untrained EAGLE-3 head for the target folder, saved as a head folder."""
    import torch

    from drafthead.heads.registry import build_head, make_config
    from drafthead.ground.target.load import load_target

    loaded = load_target(str(target))
    torch.manual_seed(0)
    head = build_head(make_config("eagle3", loaded.model, loaded.tokenizer, name=loaded.name), loaded.model)
    head.save_pretrained(out)
    return out
