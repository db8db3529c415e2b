"""What the proposers need besides their drafter classes: the head shipped for a target, a head
folder's layout and kind, and a draft model checked to share the target's vocabulary. DraftSpec (drafthead/draft_spec.py) is the one caller that maps
`--proposer` to a drafter.

Drafter modules are imported inside each function, so `import drafthead` stays light and a
proposer whose module is broken or absent only fails when asked for.
"""

from __future__ import annotations

import importlib.resources
from pathlib import Path

# Strings whose ids must agree between a target and a draft model's tokenizers (besides the
# whole-vocabulary checks): words, code, numbers, whitespace, non-Latin text and chat markup.
_VOCAB_PROBES = [
    "The quick brown fox jumps over the lazy dog.",
    "def main(argv):\n    return 0\n",
    "3.14159 + 2 = 5.14159; 1,000,000",
    "   leading and trailing spaces   ",
    "Übergrößenträger, naïve café, 東京, Москва, 🙂",
    "<|im_start|>user\nhello<|im_end|>\n",
]


class DrafterError(ValueError):
    """A drafter that cannot be built as asked (a draft model whose vocabulary is not the target's...)."""


def head_layout(head: Path) -> tuple[str, str | None]:
    """(layout, head kind) of the head folder `head`, ours or a foreign one, from its files alone."""
    from .heads.formats import detect_layout, layout_kind
    from .heads.io import CONFIG_NAME
    from .ground.files import read_json

    layout = detect_layout(head)
    if layout == "ours":
        return layout, read_json(Path(head) / CONFIG_NAME).get("config", {}).get("kind")
    return layout, layout_kind(head, layout)


def default_head_path(target_name: str) -> Path | None:
    """The head shipped for a target (`heads/pretrained/<target-name>/`, package data of
    drafthead.heads.pretrained), when one with a config.json is there; else None."""
    try:
        root = importlib.resources.files("drafthead.heads.pretrained")
    except ModuleNotFoundError:
        return None
    folder = Path(str(root)) / target_name
    return folder if (folder / "config.json").is_file() else None


# ---------------------------------------------------------------------------------------------
# Draft models
# ---------------------------------------------------------------------------------------------


def load_draft_model(draft_model, target, tokenizer, draft_tokenizer=None):
    """`draft_model` (a name or folder, loaded in the target's dtype and device; a LoadedTarget;
    or a model, whose tokenizer `draft_tokenizer` may be given) as a model on the target's device
    sharing its vocabulary."""
    from .ground.target.load import LoadedTarget, load_target

    param = next(target.parameters())
    if isinstance(draft_model, (str, Path)):
        draft_model = load_target(draft_model, dtype=param.dtype, device=param.device)
    if isinstance(draft_model, LoadedTarget):
        draft_tokenizer = draft_model.tokenizer
        draft_model = draft_model.model
    check_same_vocabulary(target, tokenizer, draft_model, draft_tokenizer)
    return draft_model


def check_same_vocabulary(target, tokenizer, draft, draft_tokenizer=None) -> None:
    """Raise DrafterError unless the draft model can propose target token ids: the same vocab
    size and, when its tokenizer is known, the same ids for the whole vocabulary and for sample
    strings (so the two tokenizers also split text the same way)."""
    t_vocab = _vocab_size(target)
    d_vocab = _vocab_size(draft)
    if t_vocab != d_vocab:
        raise DrafterError(f"draft model vocabulary ({d_vocab}) differs from the target's ({t_vocab})")
    if draft_tokenizer is None:
        return
    if len(tokenizer) != len(draft_tokenizer):
        raise DrafterError(f"draft tokenizer has {len(draft_tokenizer)} tokens, the target's {len(tokenizer)}")
    t_map, d_map = tokenizer.get_vocab(), draft_tokenizer.get_vocab()
    if t_map != d_map:
        differing = sorted(k for k in t_map.keys() | d_map.keys() if t_map.get(k) != d_map.get(k))
        raise DrafterError(f"draft and target tokenizers map {len(differing)} tokens differently (e.g. {differing[:3]})")
    # A few hundred strings through each tokenizer's full pipeline (normaliser, pre-tokenizer, merges)
    probes = _VOCAB_PROBES + [tokenizer.decode([i]) for i in range(0, len(tokenizer), max(1, len(tokenizer) // 300))]
    for text in probes:
        a = tokenizer(text, add_special_tokens=False).input_ids
        b = draft_tokenizer(text, add_special_tokens=False).input_ids
        if a != b:
            raise DrafterError(f"draft and target tokenizers encode {text[:40]!r} differently: {a[:8]} vs {b[:8]}")


def _vocab_size(model) -> int:
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return int(config.vocab_size)
