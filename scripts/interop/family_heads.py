"""The one seeded EAGLE-3 head on a tiny target family that every per-family interop row runs:
run.py's speculators, vLLM and SGLang rows and check_llamacpp_families.py. Our venv only.

The target is a tests/tiny.py family saved with the tiny tokenizer (tests/conftest.py
`save_tiny_target`), so engines that tokenize prompts and our `drafthead bench` read the same
folder; the head is random (aux layers 1, 2, 3; draft vocab 64, a multiple of the 64 rows SGLang
and vLLM pad an LM head to), nudged off its initial values so that a tensor dropped on the way
could not pass for a zero or a copied one, and, when asked, fitted for a few steps to the target's
own answers so that the engines' acceptance can be compared with ours above zero.
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


def family_head(family: str, work: Path, draft_layer: str = "llama", vocab_from=(), fit_steps: int = 0, **target):
    """(target dir, head dir, target model) under `work`: the tiny `family` target (N_LAYERS
    layers; `target` overrides tests/tiny.py's sizes) and the seeded head on it, in our format.
    draft_layer: the engines' Llama layer, or "target" for the family's own. vocab_from: prompts
    whose greedy continuations by the target pick the draft vocabulary, as training data would
    (none: the highest ids); with fit_steps, the head then learns those continuations for that
    many optimizer steps (`fit`), so that it accepts enough drafts for acceptance to compare."""
    from drafthead.heads.registry import build_head, make_config
    from drafthead.ground.target.load import load_target
    from tests.conftest import save_tiny_target

    target_dir = save_tiny_target(work / "target", family, **{"layers": N_LAYERS, **target})
    loaded = load_target(target_dir)
    model = loaded.model
    answers = [greedy_answer(model, loaded.tokenizer, p) for p in vocab_from]
    counts = torch.zeros(model.config.vocab_size, dtype=torch.long)
    for ids, start in answers:
        counts += torch.bincount(ids[0, start:], minlength=len(counts))
    if not answers:
        counts = torch.arange(model.config.vocab_size)
    torch.manual_seed(0)
    config = make_config("eagle3", model, None, name=f"tiny-{family}", aux_layers=AUX_LAYERS, draft_vocab_size=DRAFT_VOCAB, draft_layer=draft_layer)
    head = build_head(config, model, token_counts=counts, dtype=torch.float32)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(0.05 * torch.randn_like(p))
    if fit_steps:
        fit(head, model, answers, fit_steps)
    return target_dir, head.eval().save_pretrained(work / "head"), model


def greedy_answer(model, tokenizer, prompt, max_new_tokens: int = 32) -> tuple[torch.Tensor, int]:
    """([1, T] prompt + the target's greedy continuation, where the continuation starts); the chat
    template applied as our bench and the engines' harnesses apply it."""
    from drafthead.inference.bench.prompts import encode_chat

    ids = encode_chat(tokenizer, prompt)
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=model.config.pad_token_id
        )
    return out, ids.shape[1]


def fit(head, model, answers, steps: int, lr: float = 3e-3) -> None:
    """A few Adam steps of the head's own training loss (compute_loss, as the trainer calls it) on
    the target's answers, one answer per step, labels on the answer only: a smoke fit, not a run
    (`drafthead train` is the trainer)."""
    from drafthead.heads.batch import FeatureBatch
    from drafthead.train.capture.features import required_layers, target_features

    layers = required_layers(head.config, model.config.num_hidden_layers)
    batches = []
    for ids, start in answers:
        mask = torch.ones_like(ids)
        batches.append(FeatureBatch(ids, mask, torch.arange(ids.shape[1])[None] >= start, target_features(model, ids, mask, layers)))
    optimizer = torch.optim.Adam([p for p in head.parameters() if p.requires_grad], lr=lr)
    head.train()
    for step in range(steps):
        loss, _ = head.compute_loss(batches[step % len(batches)])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
