"""Checkpoints written by the upstream packages' own classes (not by our exporter) import exactly.

Each folder under tests/fixtures/interop/ holds a tiny head as its producer saved it, the
producer's own forward on `inputs.safetensors` (`reference.safetensors`) and `meta.json` (package,
version, how its ids / RoPE are counted). The scripts that regenerate them run in the producers'
own venvs: scripts/interop/fixtures_<package>.py (`make interop` builds those venvs).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from drafthead.heads.formats import detect_layout, import_head
from tests.interop import our_outputs, reference_as_ours, target_as_producer_saw
from tests.interop import FIXTURES

ROOT = FIXTURES

# fixture -> (what to import inside its folder, layout we must detect, the convention its producer counts in)
FIXTURES = {
    "speculators-eagle3": (".", "speculators", None),
    "speculators-eagle3-nbr": (".", "speculators", None),  # norm_before_residual=True
    "speculators-eagle3-train": (".", "speculators", None),  # its training CLI's defaults: + norm_before_fc, norm_output
    "speculators-eagle3-window": (".", "speculators", None),  # its trainer's sliding-window layer, window 3 of 8
    "eagle1": (".", "eagle1", "eagle"),
    "medusa": (".", "medusa", None),
    # llama.cpp's converter output; reference from llama.cpp's own eagle3 graphs (F32 KV cache)
    "llamacpp-eagle3": ("draft.gguf", "llama.cpp-gguf", None),
    # SpecForge counts aux ids as SGLang does; to_hf stores a bf16 copy of the target's embedding
    # (compared on a target with that rounding: tests/interop.py)
    "specforge-sglang": (".", "eagle3-research", "sglang"),
    "specforge-hf": (".", "eagle3-research", "sglang"),
}


@pytest.fixture(scope="module")
def target():
    return AutoModelForCausalLM.from_pretrained(ROOT / "target", dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def inputs():
    return load_file(str(ROOT / "inputs.safetensors"))


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_upstream_checkpoint_imports_exactly(name, target, inputs):
    folder = ROOT / name
    inner, layout, convention = FIXTURES[name]
    meta = json.loads((folder / "meta.json").read_text())
    assert detect_layout(folder / inner) == layout
    head = import_head(folder / inner, target_as_producer_saw(target, folder / inner), convention=convention)
    reference = reference_as_ours(head, load_file(str(folder / "reference.safetensors")))
    ours = our_outputs(head, inputs)
    assert set(reference) <= set(ours), f"{name}: reference holds {sorted(reference)}"
    for key, ref in reference.items():
        torch.testing.assert_close(
            ours[key].float(), ref.float(), atol=2e-5, rtol=1e-5, msg=lambda m: f"{name} ({meta['package']} {meta['version']}) {key}: {m}"
        )


def test_dflash_checkpoint_drafts_and_decodes_as_its_producer(target):
    """z-lab's `dflash` package saved this draft (scripts/interop/fixtures_dflash.py): imported,
    it drafts the package's own logits for the same block, and our engine's greedy output with it
    is the package's dflash_generate output, round for round."""
    from drafthead.inference.drafters.parallel import DFlashDrafter
    from drafthead.inference.engine.generate import GenerationConfig, speculative_generate

    folder = ROOT / "dflash"
    assert detect_layout(folder) == "dflash"
    head = import_head(folder, target)
    assert (head.config.feature_layers, head.block_size, head.config.mask_token_id) == ((1, 2, 3), 4, 200)
    ref = load_file(str(folder / "reference.safetensors"))
    context = ref["context"]
    with torch.no_grad():
        hs = target(context, output_hidden_states=True).hidden_states
        fused = head.fuse([hs[i] for i in head.feature_layers])
        logits = head.draft_logits(ref["block"][:, 0], context.shape[1], head.context(fused, torch.arange(context.shape[1])[None]))
    torch.testing.assert_close(logits, ref["logits"], atol=2e-5, rtol=1e-5)
    prompt, want = ref["prompt"], ref["output_ids"][0, ref["prompt"].shape[1] :]
    result = speculative_generate(target, DFlashDrafter(head), prompt, GenerationConfig(max_new_tokens=len(want)))
    assert result.new_tokens[0].tolist() == want.tolist()
    rounds = result.accepted_lengths  # tokens each round emitted, the target's own included
    # the package counts the tokens each verify produced, its first token coming from its prefill:
    # our first round (drafted on the prompt, nothing accepted) made that token, our next rounds are
    # its verify steps (its last block is cut to the tokens left)
    lengths = ref["acceptance_lengths"].tolist()
    assert rounds[0] == 1 and rounds[1 : len(lengths)] == lengths[:-1]


def test_speculators_dspark_checkpoint_imports_with_its_heads(target):
    """speculators saved this DSpark draft (scripts/interop/fixtures_speculators_dspark.py): every
    tensor lands in our head, and our Markov bias and confidence on its inputs are its own."""
    folder = ROOT / "speculators-dspark"
    assert detect_layout(folder) == "speculators"
    head = import_head(folder, target)
    assert (head.kind, head.config.feature_layers, head.block_size, head.config.markov_rank) == ("dspark", (1, 2, 3), 4, 8)
    ref = load_file(str(folder / "reference.safetensors"))
    with torch.no_grad():
        bias = head.markov_head.bias(head.markov_head.embed(ref["prev"]))
        confidence = torch.sigmoid(head.confidence_logit(ref["hidden"], ref["prev"]))
    torch.testing.assert_close(bias, ref["bias"], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(confidence, ref["confidence"], atol=1e-6, rtol=1e-6)
