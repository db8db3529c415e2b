"""The one seeded EAGLE-3 head on a tiny target family that every per-family interop row runs:
run.py's speculators, vLLM and SGLang rows and check_llamacpp_families.py. Our venv only.

The target is a tests/tiny.py family saved with the tiny tokenizer (tests/conftest.py
`save_tiny_target`), so engines that tokenize prompts and our `drafthead bench` read the same
folder; the head is random (aux layers 1, 2, 3; draft vocab 64 unless asked), nudged off its
initial values so that a tensor dropped on the way could not pass for a zero or a copied one.
Untrained: the rows check layouts, loaders and drafting maths, not acceptance levels; a draft
vocabulary of the few tokens the target emits gives such a head some acceptance to compare.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # tests/: the tiny families and the target saver

AUX_LAYERS = (1, 2, 3)
DRAFT_VOCAB = 64
N_LAYERS = 4
# export tensors the engines' loaders skip by name, on purpose: llama.cpp's converter, vLLM and
# SGLang map draft ids to target ids with d2t alone
SKIPPED_BY_NAME = frozenset({"t2d"})


def family_head(family: str, work: Path, draft_layer: str = "llama", vocab_from=(), draft_vocab: int = DRAFT_VOCAB,
                **target):
    """(target dir, head dir, target model) under `work`: the tiny `family` target (N_LAYERS
    layers; `target` overrides tests/tiny.py's sizes) and the seeded head on it, in our format.
    draft_layer: the engines' Llama layer, or "target" for the family's own. vocab_from: prompts
    whose greedy continuations by the target pick the draft vocabulary, as training data would
    (none: the highest ids)."""
    from drafthead.heads import build_head, make_config
    from drafthead.inference.targets import load_target
    from tests.conftest import save_tiny_target

    target_dir = save_tiny_target(work / "target", family, **{"layers": N_LAYERS, **target})
    loaded = load_target(target_dir)
    model = loaded.model
    counts = greedy_counts(model, loaded.tokenizer, vocab_from) if vocab_from else torch.arange(model.config.vocab_size)
    torch.manual_seed(0)
    config = make_config("eagle3", model, None, name=f"tiny-{family}", aux_layers=AUX_LAYERS,
                         draft_vocab_size=draft_vocab, draft_layer=draft_layer)
    head = build_head(config, model, token_counts=counts, dtype=torch.float32)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return target_dir, head.eval().save_pretrained(work / "head"), model


def greedy_counts(model, tokenizer, prompts, max_new_tokens: int = 32) -> torch.Tensor:
    """[V] how often the target emits each token in greedy continuations of `prompts` (chat
    template applied, as our bench and the engines' harnesses do)."""
    from drafthead.inference.prompts import encode_chat

    counts = torch.zeros(model.config.vocab_size, dtype=torch.long)
    for prompt in prompts:
        ids = encode_chat(tokenizer, prompt)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 do_sample=False, pad_token_id=model.config.pad_token_id)
        counts += torch.bincount(out[0, ids.shape[1]:], minlength=len(counts))
    return counts
