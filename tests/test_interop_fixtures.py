"""Checkpoints written by the upstream packages' own classes (not by our exporter) import exactly.

Each folder under tests/fixtures/interop/ holds a tiny head as its producer saved it, the
producer's own forward on `inputs.safetensors` (`reference.safetensors`) and `meta.json` (package,
version, how its ids / RoPE are counted). The scripts that regenerate them run in the producers'
own venvs: scripts/interop/fixtures_<package>.py (`make interop` builds those venvs).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from drafthead.heads.formats import detect_layout, import_head
from tests.interop import our_outputs, reference_as_ours, target_as_producer_saw

ROOT = Path(__file__).parent / "fixtures" / "interop"

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
        torch.testing.assert_close(ours[key].float(), ref.float(), atol=2e-5, rtol=1e-5,
                                   msg=lambda m: f"{name} ({meta['package']} {meta['version']}) {key}: {m}")
