"""The pure rules of `data capture --backend vllm` (inference/vllm/capture.py), no vLLM needed:
our hidden-state indices as vLLM's aux-layer ids, one prompt's vLLM file as our features (the
final state normed here, the others as they are), the venv looked up, and the child's protocol
through a stub vLLM package, so the parent's side runs anywhere."""

import json
import sys
import textwrap

import pytest
import torch

from drafthead.inference.vllm import capture
from drafthead.inference.vllm.capture import VllmError, VllmTarget, as_our_features, vllm_layer_ids
from tests.cli_checks import assert_refused, run_cli


def test_ids_are_ours_ascending_and_once_each():
    assert vllm_layer_ids((27, 2, 15, 30, 2), 30) == [2, 15, 27, 30]
    assert vllm_layer_ids((0,), 30) == [0]  # the embeddings: vLLM's id 0 is the input of layer 0


@pytest.mark.parametrize("layer", [31, -1])
def test_an_index_vllm_cannot_give_is_refused(layer):
    with pytest.raises(ValueError, match=r"vLLM's extract_hidden_states gives 0\.\.30"):
        vllm_layer_ids((2, layer), 30)


def test_only_the_last_state_goes_through_the_final_norm():
    hidden = torch.arange(3 * 3 * 2, dtype=torch.float32).reshape(3, 3, 2)  # [T, ids, H], ids (2, 5, 6)
    features = as_our_features(hidden, [2, 5, 6], (2, 6), 6, final_norm=lambda x: -x)
    assert features.keys() == {2, 6}
    assert torch.equal(features[2], hidden[:, 0])  # a layer input: as vLLM gave it
    assert torch.equal(features[6], -hidden[:, 2])  # L: vLLM's unnormed output, normed here


def test_a_missing_venv_names_the_folder_and_the_fix(tmp_path, monkeypatch):
    monkeypatch.delenv(capture.VENV_ENV, raising=False)
    with pytest.raises(VllmError, match="no vLLM venv there.*setup_vllm.sh"):
        capture.venv_python(tmp_path / "none")
    monkeypatch.setenv(capture.VENV_ENV, str(tmp_path / "from-env"))
    with pytest.raises(VllmError, match="from-env"):
        capture.venv_python(None)


def test_the_cli_says_a_missing_venv_in_one_line(tiny_target_dir, tmp_path, capsys):
    code, err = run_cli(
        capsys,
        "data",
        "capture",
        "--config",
        "eagle3",
        f"target={tiny_target_dir()}",
        "data.limit=2",
        "--out",
        tmp_path / "out",
        "--backend",
        "vllm",
        "--vllm-venv",
        tmp_path / "no-venv",
    )
    assert_refused(code, err, "no vLLM venv there", "no-venv")


STUB = {
    "vllm/__init__.py": """
        import json, os
        from pathlib import Path

        import torch
        from safetensors.torch import save_file

        __version__ = "stub"


        class SamplingParams:
            def __init__(self, **kwargs):
                pass


        class _Out:
            def __init__(self, path):
                self.kv_transfer_params = {"hidden_states_path": path}


        class LLM:
            def __init__(self, **kwargs):
                if os.environ.get("STUB_VLLM_FAILS"):
                    raise RuntimeError("stub engine refused the model")
                self.ids = kwargs["speculative_config"]["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"]
                self.out = kwargs["kv_transfer_config"]["kv_connector_extra_config"]["shared_storage_path"]
                self.n = 0

            def generate(self, prompts, params, use_tqdm=False):
                # each state: token id * 10 + aux id, in every one of H = 4 columns
                outs = []
                for p in prompts:
                    ids = torch.tensor(p["prompt_token_ids"])
                    hidden = (ids[:, None, None] * 10.0 + torch.tensor(self.ids)[None, :, None]).expand(-1, -1, 4)
                    path = os.path.join(self.out, f"{self.n}.safetensors")
                    self.n += 1
                    save_file({"hidden_states": hidden.contiguous().float(), "token_ids": ids}, path)
                    outs.append(_Out(path))
                return outs
        """,
    "vllm/inputs.py": """
        def TokensPrompt(prompt_token_ids):
            return {"prompt_token_ids": prompt_token_ids}
        """,
    "vllm/distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py": """
        class ExampleHiddenStatesConnector:
            pass


        def extract_from_kv_cache(kv_cache, slot_mapping, num_tokens):
            raise AssertionError("the stub engine writes its files itself")
        """,
}


class _Norm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(4))

    def forward(self, x):
        return -x


class _Model(torch.nn.Module):
    """What VllmTarget reads of a target: its config's layer count, its final norm, its dtype."""

    class config:
        @staticmethod
        def get_text_config():
            return type("Text", (), {"num_hidden_layers": 3})

    def __init__(self):
        super().__init__()
        self.model = torch.nn.Module()
        self.model.norm = _Norm()


def stub_venv(tmp_path, monkeypatch):
    """A venv folder whose python is ours, with the stub vLLM package on PYTHONPATH."""
    for name, text in STUB.items():
        path = tmp_path / "stub" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    for folder in (
        "vllm/distributed",
        "vllm/distributed/kv_transfer",
        "vllm/distributed/kv_transfer/kv_connector",
        "vllm/distributed/kv_transfer/kv_connector/v1",
    ):
        (tmp_path / "stub" / folder / "__init__.py").touch()
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    (venv / "bin" / "python").chmod(0o755)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "stub"))
    return venv


def test_batches_go_through_the_child_and_come_back_as_our_features(tmp_path, monkeypatch):
    venv = stub_venv(tmp_path, monkeypatch)
    ids = torch.tensor([[5, 6, 7], [8, 9, 0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    with VllmTarget(tmp_path / "target", _Model(), dtype="float32", max_length=8, work=tmp_path / "work", venv=venv) as engine:
        for _ in range(2):  # one engine, several batches
            features = engine.hidden_states(ids, mask, (1, 3))
        with pytest.raises(VllmError, match="started for layers"):
            engine.hidden_states(ids, mask, (2, 3))
    spec = json.loads((tmp_path / "work" / "vllm_capture_spec.json").read_text())
    assert spec["ids"] == [1, 3] and spec["max_model_len"] == 9
    expected_1 = (ids * 10.0 + 1) * mask
    assert torch.equal(features[1], expected_1[..., None].expand(-1, -1, 4))
    assert torch.equal(features[3], -((ids * 10.0 + 3) * mask)[..., None].expand(-1, -1, 4))  # normed: _Norm
    assert not list((tmp_path / "work" / "hidden_states").iterdir())  # vLLM's files read and removed


def test_a_failing_engine_is_one_line_naming_vllms_error_and_its_log(tmp_path, monkeypatch):
    venv = stub_venv(tmp_path, monkeypatch)
    monkeypatch.setenv("STUB_VLLM_FAILS", "1")
    with VllmTarget(tmp_path / "target", _Model(), dtype="float32", max_length=8, work=tmp_path / "work", venv=venv) as engine:
        with pytest.raises(VllmError, match=r"vLLM failed \(rc 1\): RuntimeError: stub engine refused the model") as e:
            engine.hidden_states(torch.tensor([[5]]), torch.tensor([[1]]), (1,))
    assert "\n" not in str(e.value) and str(engine.log) in str(e.value)
