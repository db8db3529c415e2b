"""Load our `--format speculators` DSpark export with speculators' own DSparkDraftModel (run with the
speculators venv, scripts/interop/setup_speculators.sh).

    .venv-interop/speculators/bin/python scripts/interop/check_speculators_dspark.py \
        --head out/interop/exports/speculators-dspark --inputs REF.safetensors --out PREFIX

DSparkSpeculatorConfig.from_pretrained and DSparkDraftModel.from_pretrained load the folder (the
verifier's embedding and LM head from the path its config names). Then, per tensor of the file:
the model parameter of that name holds it unchanged (`mapped`), or no parameter has that name
(`unexpected`); model parameters no tensor filled are `missing`, less those speculators takes from
the verifier (`from_verifier`: embed_tokens, lm_head, verifier_*). Last, its own Markov head
(`markov_head.prev_embeddings`, `markov_head.block_bias`) and confidence head
(`confidence_head(cat(hidden, embedding))`) on --inputs (prev [N] ids, hidden [N, H], with N a
multiple of the block) against ours (bias [N, V], confidence [N]). Writes PREFIX.json and prints it.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
from pathlib import Path

import torch
from safetensors.torch import load_file
from speculators.models.dspark import DSparkDraftModel, DSparkSpeculatorConfig

FROM_VERIFIER = ("embed_tokens.", "lm_head.", "verifier_")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--head", required=True)
    p.add_argument("--inputs", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    cfg = DSparkSpeculatorConfig.from_pretrained(args.head)
    cfg.transformer_layer_config._attn_implementation = "eager"  # noqa: SLF001
    model = DSparkDraftModel.from_pretrained(args.head, config=cfg).eval()
    params = dict(model.state_dict())
    tensors = {}
    for f in sorted(Path(args.head).glob("model*.safetensors")):
        tensors.update(load_file(str(f)))
    mapped = sorted(k for k, t in tensors.items() if k in params and torch.equal(params[k].to(t.dtype), t))
    changed = sorted(k for k in tensors if k in params and k not in mapped)
    unexpected = sorted(k for k in tensors if k not in params)
    missing = sorted(k for k in params if k not in tensors and not k.startswith(FROM_VERIFIER))
    ref = load_file(args.inputs)
    block = cfg.block_size
    n, H = ref["hidden"].shape
    with torch.no_grad():
        prev, hidden = ref["prev"].view(-1, block), ref["hidden"].view(-1, block, H)
        emb = model.markov_head.prev_embeddings(prev)
        bias = model.markov_head.block_bias(prev_token_ids=prev, hidden_states=hidden, prev_emb=emb)
        logit = model.confidence_head(torch.cat([hidden, emb.to(hidden.dtype)], dim=-1))
    out = {
        "version": md.version("speculators"),
        "tensors": len(tensors),
        "mapped": len(mapped),
        "changed": changed,
        "unexpected": unexpected,
        "missing": missing,
        "from_verifier": sorted(k for k in params if k not in tensors and k.startswith(FROM_VERIFIER)),
        "markov_bias_max_diff": float((bias.reshape(n, -1).float() - ref["bias"]).abs().max()),
        "confidence_max_diff": float((torch.sigmoid(logit).reshape(n).float() - ref["confidence"]).abs().max()),
    }
    Path(f"{args.out}.json").write_text(json.dumps(out, indent=1))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
