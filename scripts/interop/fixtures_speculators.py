"""Build tiny EAGLE-3 fixtures with speculators' own classes (run with the speculators venv).

    .venv-interop/speculators/bin/python scripts/interop/fixtures_speculators.py

Writes, for each variant, tests/fixtures/interop/<name>/:
  config.json + model.safetensors   speculators' Eagle3DraftModel.save_pretrained output
  reference.safetensors             speculators' own forward on inputs.safetensors:
                                      hidden [1,8,64]  decoder layer output (before final norm)
                                      logits [1,8,64]  lm_head(norm(hidden)), draft vocab
  meta.json

Variants:
  speculators-eagle3        Eagle3SpeculatorConfig defaults: norm_before_residual=False,
                            norm_before_fc=False, fc_norm=False, norm_output=False
  speculators-eagle3-nbr    same but norm_before_residual=True
  speculators-eagle3-train  the flags `speculators train` resolves for eagle3 by default
                            (norm_before_residual, norm_before_fc, norm_output all True; the
                            layer still uses full attention here)

How the inputs are fed (matching our convention: column t holds token x_{t+1} and feature f_t):
  Eagle3DraftModel.forward(hidden_states=features3, input_ids=input_ids,
                           document_ids=zeros[1,8], position_ids=arange(8)[None],
                           ttt_steps=1)
speculators' own batch shift (models/eagle3/data.py shift_batch) produces the same pairing
(input_ids[1:] beside hidden_states[:-1]); its default position_ids would be 1..T, which we
override with 0..T-1. hidden/logits are captured by forward hooks on layers[-1] and lm_head
during that call (forward itself returns only argmax draft tokens).
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
from speculators.train.cli import create_transformer_layer_config
from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

ROOT = Path(__file__).resolve().parents[2]
FIX = ROOT / "tests" / "fixtures" / "interop"
TARGET = FIX / "target"
INPUTS = FIX / "inputs.safetensors"

AUX_IDS = [1, 2, 3]  # speculators convention = vLLM's: input of decoder layer idx
DRAFT_VOCAB = 64
SEED = 1234

VARIANTS = {
    "speculators-eagle3": dict(norm_before_residual=False, norm_before_fc=False, fc_norm=False, norm_output=False),
    "speculators-eagle3-nbr": dict(norm_before_residual=True, norm_before_fc=False, fc_norm=False, norm_output=False),
    "speculators-eagle3-train": dict(norm_before_residual=True, norm_before_fc=True, fc_norm=False, norm_output=True),
    # the trainer's sliding-window draft layer, with a window short enough for 8 inputs to cross it
    "speculators-eagle3-window": dict(norm_before_residual=True, norm_before_fc=False, fc_norm=False, norm_output=False, sliding_window=3),
}


def verifier_path() -> str:
    # Stored verbatim as speculators_config.verifier.name_or_path; a path relative to the repo
    # root keeps the committed config machine-independent (loaders run from the repo root).
    return str(TARGET.relative_to(ROOT))


def make_mapping(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic token counts -> speculators' own d2t/t2d builder (ids 0..2 forced in)."""
    V = 256
    counts = torch.randint(1, 1000, (V,), generator=gen)
    counts[:3] = 10**6  # bos/eos/pad always in the draft vocab
    freq = {i: int(c) for i, c in enumerate(counts)}
    d2t, t2d = build_vocab_mappings_from_distribution(freq, DRAFT_VOCAB, V)
    return d2t, t2d


@torch.no_grad()
def randomize(model: Eagle3DraftModel, gen: torch.Generator) -> None:
    """Seeded non-trivial init of every trained weight (embed_tokens stays the target's)."""
    for name, p in model.named_parameters():
        if name.startswith(("embed_tokens", "verifier_")):
            continue
        if p.ndim == 1:  # RMSNorm weights
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
        else:
            p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)


def build(name: str, flags: dict, gen: torch.Generator) -> Path:
    out = FIX / name
    if out.exists():
        shutil.rmtree(out)
    # speculators' trainer helper builds the draft's LlamaConfig from the verifier's config
    flags = dict(flags)
    window = flags.pop("sliding_window", None)  # None: the full-attention layer
    tl_config = create_transformer_layer_config(
        verifier_name_or_path=verifier_path(),
        num_layers=1,
        draft_arch="llama",
        hidden_act="silu",
        sliding_window=window or 2048,
        full_attention_indices=[] if window else [0],
    )
    d2t, t2d = make_mapping(gen)
    # from_training_args: the trainer's own constructor; it copies embed_tokens (and lm_head
    # rows t2d, which randomize() then replaces) from the verifier folder.
    model = Eagle3DraftModel.from_training_args(
        verifier_config=tl_config,
        t2d=t2d,
        d2t=d2t,
        verifier_name_or_path=verifier_path(),
        target_layer_ids=AUX_IDS,
        draft_vocab_size=DRAFT_VOCAB,
        ttt_steps=3,
        draft_attn_impl="eager",
        **flags,
    )
    randomize(model, gen)
    model.save_pretrained(str(out))
    # save_pretrained also drops config.py, a verbatim copy of speculators' own
    # models/eagle3/config.py (referenced by config.json "auto_map"); speculators' loader never
    # reads it, and we do not commit upstream source, so it is removed.
    (out / "config.py").unlink(missing_ok=True)
    return out


def load_eager(folder: str | Path) -> Eagle3DraftModel:
    """speculators' own from_pretrained, with the dense 'eager' attention path (CPU-exact)."""
    cfg = Eagle3SpeculatorConfig.from_pretrained(str(folder))
    cfg.transformer_layer_config._attn_implementation = "eager"  # noqa: SLF001
    model = Eagle3DraftModel.from_pretrained(str(folder), config=cfg)
    return model.eval()


@torch.no_grad()
def run_forward(model: Eagle3DraftModel, inputs: dict) -> dict[str, torch.Tensor]:
    ids = inputs["input_ids"].long()
    feats = inputs["features3"].to(model.fc.weight.dtype)
    T = ids.shape[1]
    got: dict[str, torch.Tensor] = {}
    h1 = model.layers[-1].register_forward_hook(lambda m, a, o: got.__setitem__("hidden", o.detach().clone()))
    h2 = model.lm_head.register_forward_hook(lambda m, a, o: got.__setitem__("logits", o.detach().clone()))
    try:
        model(hidden_states=feats, input_ids=ids, document_ids=torch.zeros(1, T, dtype=torch.long), position_ids=torch.arange(T)[None], ttt_steps=1)
    finally:
        h1.remove()
        h2.remove()
    return {"hidden": got["hidden"].float().contiguous(), "logits": got["logits"].float().contiguous()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", nargs="*", default=list(VARIANTS))
    args = ap.parse_args()
    # the verifier is stored as a repo-relative path, which speculators resolves against cwd
    os.chdir(ROOT)
    torch.manual_seed(SEED)
    inputs = load_file(str(INPUTS))
    version = md.version("speculators")
    for name in VARIANTS:
        gen = torch.Generator().manual_seed(SEED + sorted(VARIANTS).index(name))
        if name not in args.only:
            continue
        flags = VARIANTS[name]
        out = build(name, flags, gen)
        model = load_eager(out)  # reference from the checkpoint as a consumer loads it
        ref = run_forward(model, inputs)
        save_file(ref, str(out / "reference.safetensors"))
        meta = {
            "package": "speculators",
            "version": version,
            "writer": "speculators.models.eagle3.Eagle3DraftModel.from_training_args(...)"
            ".save_pretrained (transformer_layer_config from "
            "speculators.train.cli.create_transformer_layer_config, d2t/t2d from "
            "speculators.train.vocab_mapping.build_vocab_mappings_from_distribution)",
            "aux_id_convention": "vllm",
            "flags": flags,
            "eagle_aux_hidden_state_layer_ids": AUX_IDS,
            "notes": (
                "reference = Eagle3DraftModel.from_pretrained(folder, config with "
                "transformer_layer_config._attn_implementation='eager').forward("
                "hidden_states=features3, input_ids=input_ids, document_ids=zeros, "
                "position_ids=arange(8), ttt_steps=1); hidden = layers[-1] output (pre final "
                "norm), logits = lm_head output = lm_head(norm(hidden)) over the 64-token draft "
                "vocab (target id = i + d2t[i]). Column t pairs token x_{t+1} with feature f_t "
                "(speculators' shift_batch does the same). Random seeded weights; embed_tokens "
                "copied from the fixture target by from_training_args. verifier.name_or_path is "
                "the repo-relative path tests/fixtures/interop/target: load with cwd = repo root. "
                "save_pretrained's config.py (a copy of speculators' eagle3 config source, "
                "named by auto_map) was deleted; loading does not need it."
                + (" norm_before_fc: input_norm.weight [192] RMSNorm on the fc input." if flags["norm_before_fc"] else "")
                + (" norm_output: the next TTT step would get norm(hidden); not exercised (one step)." if flags["norm_output"] else "")
            ),
        }
        (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
        size = sum(p.stat().st_size for p in out.iterdir())
        print(
            json.dumps({"fixture": name, "bytes": size, "hidden_absmax": float(ref["hidden"].abs().max()), "logits_std": float(ref["logits"].std())})
        )


if __name__ == "__main__":
    main()
