#!/usr/bin/env python
"""Write the SpecForge EAGLE-3 fixtures with SpecForge's OWN draft class and exporters.

Run with the SpecForge venv (scripts/interop/setup_specforge.sh):

    .venv-interop/specforge/bin/python scripts/interop/fixtures_specforge.py

Writes, next to the fixture target (tests/fixtures/interop/target, hidden 64, vocab 256):
  tests/fixtures/interop/specforge-sglang/   specforge.export.to_sglang.export_to_sglang output
  tests/fixtures/interop/specforge-hf/       specforge.export.to_hf.export_to_hf output
                                             (embed_tokens copied from the fixture target)
each with reference.safetensors and meta.json.

How the checkpoint is made (all upstream code except the seeded weight values):
  1. a draft config (LlamaForCausalLMEagle3, 1 layer, draft vocab 64, eagle_config ids [1, 2, 3] in
     SpecForge's = SGLang's convention) is read by specforge.modeling.auto.AutoDraftModelConfig.from_file
     and built by AutoDraftModel.from_config (SpecForge's LlamaForCausalLMEagle3, sdpa backend);
  2. weights: seeded; every Linear N(0, 1/fan_in), every RMSNorm weight 1 + 0.1 N(0, 1); embed_tokens
     copied from the fixture target; d2t / t2d from SpecForge's own
     specforge.data.preprocessing.process_token_dict_to_mappings on a seeded token Counter;
  3. the draft state (embeddings dropped, as SpecForge's trainer checkpoints do) is saved as the
     training_state.pt dict the exporters resolve ({"strategy": "eagle3", "draft_state_dict": ...})
     in a temporary folder, and the two exporters run on it. Both exporters rebuild the draft in
     bfloat16 (export/checkpoint_io.py:materialize_draft), so the fixtures hold bf16 tensors.

Reference (reference.safetensors): the exported folder is loaded back with SpecForge's own
AutoDraftModelConfig.from_file + AutoDraftModel.from_config + load_state_dict in float32 (not
from_pretrained: it leaves the rotary caches uninitialised under transformers 5.8.1) (for specforge-sglang, which has no embed_tokens,
embeddings come from the target through SpecForge's own Eagle3DraftModel.load_embedding), then
the training-time step 0 of specforge/algorithms/eagle3/model.py runs on inputs.safetensors:
    h = draft.backbone(embed_input_ids(input_ids), project_hidden_states(features3),
                       cache_hidden=[[], []], attention_mask=prepare_decoder_attention_mask(ones),
                       position_ids=arange(T))
    hidden = h (pre-norm decoder-layer output), logits = compute_logits(h) = lm_head(norm(h))
Alignment: columns as given in inputs.safetensors: column t gets token input_ids[t] (= x_{t+1})
and fused feature features3[t] (of position t), positions 0..T-1, causal, no KV cache, one step.
TORCHDYNAMO_DISABLE=1: SpecForge's LlamaRMSNorm.forward is wrapped in @torch.compile; compiling it
on this CPU box costs time and changes nothing in the maths, so dynamo is off (eager).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import warnings
from collections import Counter
from pathlib import Path

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
warnings.filterwarnings("ignore")

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
FIX = ROOT / "tests" / "fixtures" / "interop"


def draft_config(target_cfg: dict, aux_ids, draft_vocab: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": target_cfg["hidden_size"],
        "intermediate_size": target_cfg["intermediate_size"],
        "num_attention_heads": target_cfg["num_attention_heads"],
        "num_key_value_heads": target_cfg["num_key_value_heads"],
        "head_dim": target_cfg["head_dim"],
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": target_cfg["rms_norm_eps"],
        "max_position_embeddings": target_cfg["max_position_embeddings"],
        "rope_theta": target_cfg["rope_parameters"]["rope_theta"],
        "vocab_size": target_cfg["vocab_size"],
        "draft_vocab_size": draft_vocab,
        "target_hidden_size": target_cfg["hidden_size"],
        "bos_token_id": target_cfg["bos_token_id"],
        "eos_token_id": target_cfg["eos_token_id"],
        "pad_token_id": target_cfg["pad_token_id"],
        "attention_bias": False,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(aux_ids), "use_aux_hidden_state": True},
    }


def vocab_mapping(draft_vocab: int, target_vocab: int, seed: int):
    """SpecForge's own d2t / t2d builder on a seeded token-frequency Counter.

    specforge/data/preprocessing.py imports `datasets.Dataset` at module level for its dataset
    builders; the mapping function does not use it, so when `datasets` is not installed (the
    venv keeps to what the draft/export code needs) a stand-in module satisfies that import."""
    try:
        import datasets  # noqa: F401
    except ImportError:
        import types

        stub = types.ModuleType("datasets")
        stub.Dataset = type("Dataset", (), {})
        sys.modules["datasets"] = stub
    from specforge.data.preprocessing import process_token_dict_to_mappings

    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, 1000, (target_vocab,), generator=g)
    counts[torch.randperm(target_vocab, generator=g)[: target_vocab // 3]] = 0  # some tokens never seen
    token_dict = Counter({i: int(c) for i, c in enumerate(counts.tolist()) if c > 0})
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()):
        return process_token_dict_to_mappings(token_dict, draft_vocab, target_vocab)


@torch.no_grad()
def seeded_draft(cfg_path: Path, target_dir: Path, seed: int):
    from specforge.modeling.auto import AutoDraftModel, AutoDraftModelConfig

    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()):
        config = AutoDraftModelConfig.from_file(str(cfg_path))
    torch.manual_seed(seed)
    model = AutoDraftModel.from_config(config).float().eval()
    g = torch.Generator().manual_seed(seed)
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear):
            mod.weight.copy_(torch.randn(mod.weight.shape, generator=g) * mod.weight.shape[1] ** -0.5)
        elif type(mod).__name__.endswith("RMSNorm"):
            mod.weight.copy_(1 + 0.1 * torch.randn(mod.weight.shape, generator=g))
    model.load_embedding(str(target_dir))  # SpecForge's own: model.embed_tokens.weight of the target
    d2t, t2d = vocab_mapping(config.draft_vocab_size, config.vocab_size, seed)
    model.d2t.copy_(d2t)
    model.t2d.copy_(t2d)
    return model, config


@torch.no_grad()
def specforge_reference(folder: Path, target_dir: Path, inputs: dict) -> dict:
    """SpecForge's own classes, training-time TTT step 0 (algorithms/eagle3/model.py), float32."""
    from specforge.modeling.auto import AutoDraftModel

    import contextlib
    import io

    # Not AutoDraftModel.from_pretrained: with transformers 5.8.1 it leaves the draft's non-persistent
    # rotary buffers (rotary_emb.inv_freq / cos_cached / sin_cached) uninitialised (NaN / 1e36
    # garbage), see findings. SpecForge's own exporters build the draft the other way
    # (export/checkpoint_io.py:materialize_draft): from_config + load_state_dict, as done here.
    from specforge.modeling.auto import AutoDraftModelConfig

    with contextlib.redirect_stdout(io.StringIO()):
        config = AutoDraftModelConfig.from_file(str(folder / "config.json"))
    draft = AutoDraftModel.from_config(config).float().eval()
    files = load_file(str(folder / "model.safetensors"))
    missing, unexpected = draft.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in files.items()}, strict=False)
    assert not unexpected and set(missing) <= {"embed_tokens.weight"}, (missing, unexpected)
    if "embed_tokens.weight" not in files:
        draft.load_embedding(str(target_dir))
    ids, feats = inputs["input_ids"], inputs["features3"].float()
    B, T = ids.shape
    hidden = draft.project_hidden_states(feats)
    mask = draft.prepare_decoder_attention_mask(
        attention_mask=torch.ones(B, T, dtype=torch.bool), hidden_states=hidden, batch_size=B, seq_length=T, past_key_values_length=0
    )
    pos = torch.arange(T)[None]
    h = draft.backbone(
        input_embeds=draft.embed_input_ids(ids).to(hidden.dtype),
        hidden_states=hidden,
        cache_hidden=[[], []],
        attention_mask=mask,
        position_ids=pos,
        past_key_values=None,
        use_cache=True,
    )
    # the one-shot path (no TTT cache) must agree: SpecForge's own sdpa branch
    h2 = draft.backbone(
        input_embeds=draft.embed_input_ids(ids).to(hidden.dtype),
        hidden_states=hidden,
        cache_hidden=None,
        attention_mask=mask,
        position_ids=pos,
        past_key_values=None,
        use_cache=False,
    )
    assert (h - h2).abs().max().item() < 1e-5, "SpecForge's cached and uncached sdpa paths disagree"
    return {"hidden": h.float().contiguous(), "logits": draft.compute_logits(h).float().contiguous()}, draft


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default=str(FIX / "target"))
    ap.add_argument("--inputs", default=str(FIX / "inputs.safetensors"))
    ap.add_argument("--out-root", default=str(FIX))
    ap.add_argument("--aux-ids", default="1,2,3", help="eagle_config ids, SpecForge's (= SGLang's) convention")
    ap.add_argument("--draft-vocab", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    import importlib.metadata as md

    from specforge.export import export_to_hf, export_to_sglang

    version = md.version("specforge")
    target_dir = Path(args.target)
    target_cfg = json.loads((target_dir / "config.json").read_text())
    aux_ids = [int(x) for x in args.aux_ids.split(",")]
    inputs = load_file(args.inputs)
    out_root = Path(args.out_root)
    summary = {}
    with tempfile.TemporaryDirectory(prefix="specforge_fixture_") as tmp:
        tmp = Path(tmp)
        cfg_path = tmp / "draft_config.json"
        cfg_path.write_text(json.dumps(draft_config(target_cfg, aux_ids, args.draft_vocab), indent=2))
        model, _ = seeded_draft(cfg_path, target_dir, args.seed)
        state = {"strategy": "eagle3", "draft_state_dict": {k: v.clone() for k, v in model.state_dict().items() if "embed" not in k.lower()}}
        torch.save(state, tmp / "training_state.pt")
        jobs = {
            "specforge-sglang": (
                "specforge.export.to_sglang.export_to_sglang",
                lambda d: export_to_sglang(str(tmp / "training_state.pt"), str(cfg_path), str(d)),
            ),
            "specforge-hf": (
                "specforge.export.to_hf.export_to_hf (embedding_source = fixture target)",
                lambda d: export_to_hf(str(tmp / "training_state.pt"), str(cfg_path), str(d), embedding_source=str(target_dir)),
            ),
        }
        for name, (writer, run) in jobs.items():
            out = out_root / name
            if out.exists():
                shutil.rmtree(out)
            import contextlib
            import io

            with contextlib.redirect_stdout(io.StringIO()):
                run(out)
            ref, draft = specforge_reference(out, target_dir, inputs)
            save_file(ref, str(out / "reference.safetensors"))
            w = load_file(str(out / "model.safetensors"))
            d2t, t2d = w["d2t"], w["t2d"]
            valid = bool(t2d.sum().item() == d2t.numel() and torch.equal(torch.nonzero(t2d).flatten(), d2t + torch.arange(d2t.numel())))
            cfg_out = json.loads((out / "config.json").read_text())
            meta = {
                "package": "specforge",
                "version": version,
                "writer": writer,
                "aux_id_convention": "sglang",
                "notes": (
                    f"SpecForge LlamaForCausalLMEagle3 (AutoDraftModel), seed {args.seed}; Linear N(0,1/fan_in), "
                    f"norms 1+0.1N(0,1); d2t/t2d from specforge.data.preprocessing.process_token_dict_to_mappings "
                    f"(valid: {valid}); tensors stored {sorted({str(v.dtype) for v in w.values()})} "
                    f"(the exporters rebuild the draft in bf16). eagle_config ids {aux_ids} are SpecForge's = SGLang's "
                    f"convention (SGLang captures the input of layer id+1 = HF output_hidden_states[id+1]). "
                    f"Keys: {sorted(w)}. embed_tokens "
                    f"{'present (target copy)' if 'embed_tokens.weight' in w else 'absent'}"
                    f"{'' if 'embed_tokens.weight' in w else ' (to_sglang drops it; SGLang and SpecForge take the target embedding)'}. "
                    f"config norm_output absent -> SpecForge default True = logits lm_head(norm(h)), pre-norm h fed "
                    f"back. Reference: SpecForge's own backbone/compute_logits (algorithms/eagle3/model.py TTT step 0) "
                    f"in float32 on the stored weights; column t = token input_ids[t] (x_(t+1)) beside features3[t], "
                    f"positions 0..T-1, causal, one step, TORCHDYNAMO_DISABLE=1 (RMSNorm's @torch.compile off)."
                ),
                "config_keys": sorted(cfg_out),
                "generator": "scripts/interop/fixtures_specforge.py",
            }
            (out / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
            size = sum(f.stat().st_size for f in out.iterdir())
            summary[name] = {
                "files": sorted(f.name for f in out.iterdir()),
                "bytes": size,
                "keys": sorted(w),
                "d2t_t2d_valid": valid,
                "hidden_abs_mean": ref["hidden"].abs().mean().item(),
                "logits_std": ref["logits"].std().item(),
            }
    print(json.dumps(summary))


if __name__ == "__main__":
    sys.exit(main())
