"""Small helpers the consumer harnesses share. Plain Python on purpose: each harness runs in its
consumer's own venv (scripts/interop/setup_<name>.sh) and imports this file from beside it."""

from __future__ import annotations

import argparse
from pathlib import Path


def stub_tokenizer(module, notes: list) -> None:
    """The upstream wrappers' __init__ loads the target's tokenizer, which the heads never use. Fall back
    to None when that fails (no tokenizer in the folder, or one saved by transformers 5 with
    tokenizer_class "TokenizersBackend", which transformers 4.x cannot build), and say so in the notes."""
    real = module.AutoTokenizer.from_pretrained

    def load(*a, **k):
        try:
            return real(*a, **k)
        except Exception as e:  # noqa: BLE001
            notes.append(f"target tokenizer not loadable by this transformers ({type(e).__name__}: {str(e)[:120]}); stubbed")
            return None

    module.AutoTokenizer.from_pretrained = staticmethod(load)


def harness_args(full_help: str, compared: str) -> argparse.Namespace:
    """The upstream harnesses' shared command line (--head/--target/--inputs/--out, --full, --dtype,
    --reference). full_help: what --full loads; compared: the reference tensor --reference checks."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--head", required=True, type=Path)
    ap.add_argument("--target", required=True, type=Path)
    ap.add_argument("--inputs", required=True, type=Path)
    ap.add_argument("--out", required=True)
    ap.add_argument("--full", action="store_true", help=full_help)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    ap.add_argument("--reference", type=Path, help=f"optional reference.safetensors to compare `{compared}` with")
    return ap.parse_args()
