"""Small helpers the consumer harnesses share. Plain Python on purpose: each harness runs in its
consumer's own venv (scripts/interop/setup_<name>.sh) and imports this file from beside it."""
from __future__ import annotations


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
