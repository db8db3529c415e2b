"""`data capture --backend llama.cpp`: the hidden states an EAGLE-3 head trains on, captured through
libllama's layer inputs (and its final normed state) on SmolLM2-135M's f32 GGUF, against our own
torch capture of the same samples: the same tokens and masks, and per layer the same states up to
two fp32 engines' rounding. Marked `llamacpp` (`make test-llamacpp`).
"""

import pytest
import torch

from tests.cli_checks import run_cli
from tests.trainer_checks import shards

pytestmark = pytest.mark.llamacpp


def test_llamacpp_capture_equals_ours_per_layer(tmp_path, capsys):
    common = [
        "data",
        "capture",
        "--config",
        "eagle3",
        "target_dtype=float32",
        "features.dtype=float32",
        "data.limit=6",
        "data.max_length=192",
        "threads=2",
    ]
    ours, theirs = tmp_path / "torch", tmp_path / "llamacpp"
    assert run_cli(capsys, *common, "--out", ours)[0] == 0
    assert run_cli(capsys, *common, "--out", theirs, "--backend", "llama.cpp")[0] == 0
    a, b = shards(ours), shards(theirs)
    assert a.keys() == b.keys()
    for key in ("input_ids", "attention_mask", "loss_mask"):
        assert torch.equal(a[key], b[key]), key
    table = {}
    for key in sorted(k for k in a if k.startswith("hidden.")):
        difference = (a[key] - b[key]).abs()
        relative = float((a[key] - b[key]).norm() / a[key].norm())
        table[key] = (float(difference.max()), float(a[key].abs().max()), relative)
        assert relative < 1e-3, (key, table[key])
    print("layer, max |torch - llama.cpp|, max |torch|, relative norm error:", table)
    assert len(table) >= 3  # EAGLE-3's low, mid and high layers at least
