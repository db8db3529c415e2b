"""Build a tiny DSpark fixture with speculators' own classes (run with the speculators venv).

    nice -n 19 .venv-interop/speculators/bin/python scripts/interop/fixtures_speculators_dspark.py

Writes tests/fixtures/interop/speculators-dspark/:
  config.json + model.safetensors   speculators' DSparkDraftModel.save_pretrained output
  reference.safetensors             speculators' own Markov / confidence head outputs:
                                      prev              [8]       int64 previous-token ids
                                      hidden            [8,64]    random slot states
                                      markov_emb        [8,8]     markov_head.prev_embeddings(prev)
                                      bias              [8,256]   Markov logit bias for prev
                                      confidence_logit  [8]       confidence head logit
                                      confidence        [8]       sigmoid(confidence_logit)
  meta.json

The draft is built for the tiny target in tests/fixtures/interop/target (Llama, 4 layers,
hidden 64, vocab 256) the way `speculators train --speculator-type dspark` builds it:
  transformer_layer_config  speculators.train.cli.create_transformer_layer_config(
                              draft_arch="qwen3" (the trainer default outside eagle3),
                              num_layers=1, full_attention_indices=[0])
  model                     DSparkDraftModel.from_training_args(t2d=None, d2t=None,
                              draft_vocab_size=256 (= target vocab: full vocabulary),
                              block_size=4, sample_from_anchor=True, markov_rank=8,
                              markov_head_type="vanilla", enable_confidence_head=True,
                              confidence_head_with_markov=True, target_layer_ids=[1,2,3],
                              mask_token_id=255)
Every trainable parameter is then overwritten with seeded noise (norm weights 1+0.1*N,
biases 0.1*N, matrices N/sqrt(fan_in)). embed_tokens / lm_head / verifier_* are the target's
frozen weights: from_training_args copies them in, and for a full-vocabulary draft
save_pretrained leaves all of them (and d2t/t2d, which stay None) out of model.safetensors.

The reference is computed on the model reloaded with DSparkDraftModel.from_pretrained(folder),
with the inputs laid out as DSparkDraftModel.forward lays them out ([num_blocks, block_size],
here 2 blocks of 4; with sample_from_anchor=True slot k's previous token is the block token at
k, i.e. the anchor for slot 0):
  markov_emb        = model.markov_head.prev_embeddings(prev_blocks)
  bias              = model.markov_head.block_bias(prev_token_ids=prev_blocks,
                                                   hidden_states=hidden_blocks,
                                                   prev_emb=markov_emb)
  confidence_logit  = model.confidence_head(cat([hidden_blocks, markov_emb], -1))
                      (ConfidenceHead.forward: proj(features).squeeze(-1))
  confidence        = torch.sigmoid(confidence_logit)
all flattened back to [8, ...].
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from speculators.models.dspark import DSparkDraftModel, DSparkSpeculatorConfig
from speculators.train.cli import create_transformer_layer_config

ROOT = Path(__file__).resolve().parents[2]
FIX = ROOT / "tests" / "fixtures" / "interop"
TARGET = FIX / "target"
OUT = FIX / "speculators-dspark"

AUX_IDS = [1, 2, 3]  # speculators convention = vLLM's: input of decoder layer idx
MASK_TOKEN_ID = 255  # target: bos 0, eos 1, pad 2; 255 is an ordinary id
BLOCK_SIZE = 4
MARKOV_RANK = 8
SEED = 4321
FLAGS = dict(
    block_size=BLOCK_SIZE,
    sample_from_anchor=True,
    markov_rank=MARKOV_RANK,
    markov_head_type="vanilla",
    enable_confidence_head=True,
    confidence_head_with_markov=True,
)
FROZEN = ("embed_tokens", "lm_head", "verifier_")


def verifier_path() -> str:
    # stored verbatim as speculators_config.verifier.name_or_path; repo-relative on purpose
    return str(TARGET.relative_to(ROOT))


@torch.no_grad()
def randomize(model: DSparkDraftModel, gen: torch.Generator) -> list[str]:
    """Seeded non-trivial values for every trainable parameter (frozen target weights kept)."""
    done = []
    for name, p in model.named_parameters():
        if name.startswith(FROZEN) or not p.requires_grad:
            continue
        if p.ndim == 1 and "norm" in name:
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
        elif p.ndim == 1:
            p.copy_(0.1 * torch.randn(p.shape, generator=gen))
        else:
            p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)
        done.append(name)
    return done


def build(gen: torch.Generator) -> tuple[DSparkDraftModel, list[str]]:
    tl_config = create_transformer_layer_config(
        verifier_name_or_path=verifier_path(), num_layers=1, draft_arch="qwen3", hidden_act="silu", sliding_window=2048, full_attention_indices=[0]
    )
    vocab = tl_config.vocab_size
    model = DSparkDraftModel.from_training_args(
        verifier_config=tl_config,
        t2d=None,
        d2t=None,
        verifier_name_or_path=verifier_path(),
        target_layer_ids=AUX_IDS,
        draft_vocab_size=vocab,
        mask_token_id=MASK_TOKEN_ID,
        draft_attn_impl="eager",
        **FLAGS,
    )
    return model, randomize(model, gen)


@torch.no_grad()
def reference(model: DSparkDraftModel, gen: torch.Generator) -> dict[str, torch.Tensor]:
    H = model.config.transformer_layer_config.hidden_size
    V = model.verifier_vocab_size
    n = 2 * BLOCK_SIZE
    prev = torch.randint(0, V, (n,), generator=gen)
    prev[:4] = torch.tensor([0, 2, MASK_TOKEN_ID, V - 2])  # bos, pad, mask, high id
    hidden = torch.randn(n, H, generator=gen)
    prev_b, hidden_b = prev.view(-1, BLOCK_SIZE), hidden.view(-1, BLOCK_SIZE, H)
    emb = model.markov_head.prev_embeddings(prev_b)
    bias = model.markov_head.block_bias(prev_token_ids=prev_b, hidden_states=hidden_b, prev_emb=emb)
    logit = model.confidence_head(torch.cat([hidden_b, emb.to(hidden_b.dtype)], dim=-1))
    return {
        "prev": prev.long().contiguous(),
        "hidden": hidden.float().contiguous(),
        "markov_emb": emb.reshape(n, -1).float().contiguous(),
        "bias": bias.reshape(n, -1).float().contiguous(),
        "confidence_logit": logit.reshape(n).float().contiguous(),
        "confidence": torch.sigmoid(logit).reshape(n).float().contiguous(),
    }


def main() -> None:
    os.chdir(ROOT)  # the verifier path is repo-relative
    torch.manual_seed(SEED)
    gen = torch.Generator().manual_seed(SEED)
    if OUT.exists():
        shutil.rmtree(OUT)
    model, randomized = build(gen)
    model.save_pretrained(str(OUT))
    # as for the EAGLE-3 fixtures: drop save_pretrained's copy of speculators' config source
    (OUT / "config.py").unlink(missing_ok=True)
    extra = sorted(p.name for p in OUT.iterdir() if p.name not in ("config.json", "model.safetensors"))
    if extra:
        raise SystemExit(f"unexpected files from save_pretrained: {extra}")

    # reference from the checkpoint as a consumer loads it
    cfg = DSparkSpeculatorConfig.from_pretrained(str(OUT))
    cfg.transformer_layer_config._attn_implementation = "eager"  # noqa: SLF001
    loaded = DSparkDraftModel.from_pretrained(str(OUT), config=cfg).eval()
    ref = reference(loaded, gen)
    save_file(ref, str(OUT / "reference.safetensors"))

    meta = {
        "package": "speculators",
        "version": md.version("speculators"),
        "writer": "speculators.models.dspark.DSparkDraftModel.from_training_args(...)"
        ".save_pretrained (transformer_layer_config from "
        "speculators.train.cli.create_transformer_layer_config, draft_arch=qwen3)",
        "aux_id_convention": "vllm",
        "aux_hidden_state_layer_ids": AUX_IDS,
        "mask_token_id": MASK_TOKEN_ID,
        "flags": FLAGS,
        "randomized": randomized,
        "notes": (
            "Full draft vocabulary (draft_vocab_size = target vocab 256): no d2t/t2d, and "
            "embed_tokens / lm_head are the target's (not stored). Random seeded weights. "
            "reference = DSparkDraftModel.from_pretrained(folder) heads on prev/hidden viewed "
            "as [2 blocks, 4]: markov_emb = markov_head.prev_embeddings(prev), bias = "
            "markov_head.block_bias(prev_token_ids, hidden_states, prev_emb) = markov_w2("
            "markov_w1[prev]) (vanilla), confidence_logit = confidence_head(cat[hidden, "
            "markov_emb]) = proj(.).squeeze(-1), confidence = sigmoid(confidence_logit). In "
            "DSparkDraftModel.forward with sample_from_anchor=True, slot k's prev is the block "
            "token at k (slot 0: the anchor). verifier.name_or_path is the repo-relative path "
            "tests/fixtures/interop/target: load with cwd = repo root. save_pretrained's "
            "config.py (a copy of speculators' source, named by auto_map) was deleted."
        ),
    }
    (OUT / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    size = sum(p.stat().st_size for p in OUT.iterdir())
    print(
        json.dumps(
            {"fixture": OUT.name, "bytes": size, "bias_std": float(ref["bias"].std()), "confidence": [round(float(c), 4) for c in ref["confidence"]]}
        )
    )


if __name__ == "__main__":
    main()
