"""The `llama.cpp` export, checked by llama.cpp's own code on every tiny target family.

llama.cpp only reads EAGLE-3 drafts: it writes no checkpoint of its own that an export could be
compared with (the HF folder in tests/fixtures/interop/llamacpp-eagle3 is ours, the converter's
input; only its draft.gguf is llama.cpp's). So the consumer itself is the check:
scripts/interop/check_llamacpp_families.py exports a seeded EAGLE-3 head per family, converts it
with llama.cpp's `convert_hf_to_gguf.py` and loads the GGUF in libllama. libllama's loader refuses
a tensor it needs and does not find, any tensor left over and any shape other than the one it
builds from the GGUF's hyperparameters, so a load proves every name and shape. Those
hyperparameters are what the converter read from the export's config.json, falling back to its
own defaults for a key it does not find (the aux ids to [2, L/2, L-3], the flags to false): each
is compared with what our config states.

Needs libllama and the converter (`make llamacpp`): the `llamacpp` marker's suite.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tiny import FAMILIES

pytestmark = pytest.mark.llamacpp
REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "interop" / "check_llamacpp_families.py"


def run_check(out: Path, *args: str) -> dict[str, dict]:
    """The script's rows, by family (it exits 1 when a family fails: its row says how)."""
    subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), *args], cwd=REPO, capture_output=True, timeout=3000)
    return {row["family"]: row for row in json.loads(out.read_text())["families"]}


@pytest.fixture(scope="module")
def rows(tmp_path_factory) -> dict[str, dict]:
    return run_check(tmp_path_factory.mktemp("llamacpp") / "families.json")


def stated(cfg: dict) -> dict:
    """What our export's config says for each hyperparameter the GGUF carries (GGUF key, less the
    architecture prefix -> value)."""
    return {
        "target_layers": cfg["eagle_aux_hidden_state_layer_ids"],
        "target_hidden_size": cfg["target_hidden_size"],
        "norm_before_residual": cfg["norm_before_residual"],
        "norm_before_fc": cfg["norm_before_fc"],
        "embedding_length": cfg["hidden_size"],
        "feed_forward_length": cfg["intermediate_size"],
        "attention.head_count": cfg["num_attention_heads"],
        "attention.head_count_kv": cfg["num_key_value_heads"],
        "attention.key_length": cfg["head_dim"],
        "context_length": cfg["max_position_embeddings"],
        "block_count": cfg["num_hidden_layers"],
    }


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_llamacpps_converter_and_loader_take_the_eagle3_export(rows, family):
    row = rows[family]
    assert row["status"] == "loads", row.get("error") or row.get("loader")
    assert row["loader"]["tensors_in_file"] == len(row["gguf"])  # libllama took every tensor the GGUF holds
    cfg, meta = row["export_config"], row["gguf_meta"]
    assert meta["architecture"] == "eagle3"
    differ = {key: (meta.get(key), want) for key, want in stated(cfg).items() if meta.get(key) != want}
    assert not differ, f"GGUF hyperparameter (GGUF, our config): {differ}"
    assert meta["attention.layer_norm_rms_epsilon"] == pytest.approx(cfg["rms_norm_eps"], rel=1e-6)
    assert meta.get("rope.freq_base", 10000.0) == pytest.approx(cfg["rope_theta"], rel=1e-6)


def test_libllama_refuses_an_export_with_a_tensor_missing(tmp_path):
    """The negative control: the same check on an export without its final norm fails."""
    row = run_check(tmp_path / "dropped.json", "--families", "llama", "--drop", "norm.weight")["llama"]
    assert row["status"] != "loads" and not row.get("loader", {}).get("loaded")
    assert "output_norm" in (row.get("error") or row["loader"]["error"])
