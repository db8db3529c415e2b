"""`data capture --backend vllm`: the hidden states an EAGLE-3 head trains on, captured through vLLM's
own `extract_hidden_states` method and hidden-states connector (vLLM's CPU build, in its own venv)
on SmolLM2-135M in fp32, against our own torch capture of the same samples: the same tokens and
masks, and per layer the same states up to two fp32 engines' rounding; the final state is vLLM's
unnormed last output through the target's final norm (inference/vllm/capture.py). Marked `vllm`
(`make test-vllm`); the venv is $DRAFTHEAD_VLLM_VENV or the checkout's .venv-interop/vllm.
"""

import json
import time

import pytest

from tests.trainer_checks import shards
from tests.cli_checks import run_cli

pytestmark = pytest.mark.vllm


def test_vllm_capture_equals_ours_per_layer(tmp_path, capsys):
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
    ours, theirs = tmp_path / "torch", tmp_path / "vllm"
    start = time.perf_counter()
    assert run_cli(capsys, *common, "--out", ours)[0] == 0
    middle = time.perf_counter()
    code, err = run_cli(capsys, *common, "--out", theirs, "--backend", "vllm")
    assert code == 0, err
    end = time.perf_counter()
    assert json.loads((theirs / "index.json").read_text())["meta"]["engine"] == "VllmTarget"
    a, b = shards(ours), shards(theirs)
    assert a.keys() == b.keys()
    for key in ("input_ids", "attention_mask", "loss_mask"):
        assert (a[key] == b[key]).all(), key
    table = {}
    for key in sorted((k for k in a if k.startswith("hidden.")), key=lambda k: int(k.split(".")[1])):
        difference = (a[key] - b[key]).abs()
        relative = float((a[key] - b[key]).norm() / a[key].norm())
        table[key] = (float(difference.max()), float(a[key].abs().max()), relative)
        assert relative < 1e-4, (key, table[key])
    print(f"\ntokens: {a['input_ids'].numel()}; torch capture {middle - start:.1f} s, vLLM capture {end - middle:.1f} s")
    print("layer, max |torch - vLLM|, max |torch|, relative norm error:", table)
    assert list(table) == ["hidden.2", "hidden.15", "hidden.27", "hidden.30"]  # EAGLE-3's three and L
