"""`bench --compare vllm`'s plumbing (inference/vllm/plain_rows.py): the spec goes to a child
process of vLLM's Python, which runs plain_child.py and writes its rows back. vLLM itself is
replaced by a stub package on the child's PYTHONPATH, so this runs anywhere; an absent venv is a
skip with its reason."""

import sys
import textwrap
from pathlib import Path

from drafthead.inference.vllm import interpreter, plain_rows

STUB = """
class SamplingParams:
    def __init__(self, temperature, max_tokens, stop_token_ids=()):
        self.max_tokens = max_tokens


class _Out:
    def __init__(self, ids):
        self.token_ids = ids


class _Request:
    def __init__(self, ids):
        self.outputs = [_Out(ids)]


class LLM:
    def __init__(self, **kwargs):
        pass

    def generate(self, prompts, params, use_tqdm=False):  # echoes the prompt's first tokens
        return [_Request(list(p["prompt_token_ids"][: params.max_tokens])) for p in prompts]
"""


def test_a_missing_vllm_venv_is_a_skip_with_its_reason(tmp_path, monkeypatch):
    monkeypatch.setattr(interpreter, "VLLM_PYTHON", tmp_path / "no-venv" / "bin" / "python")
    rows, skipped = plain_rows.vllm_rows(tmp_path, [[1, 2]], [0], 4, "float32", 1, tmp_path / "work")
    assert rows == {} and "not installed" in skipped["vllm"]


def test_the_child_runs_in_vllms_python_and_returns_one_row_per_prompt(tmp_path, monkeypatch):
    stub = tmp_path / "stub" / "vllm"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text(textwrap.dedent(STUB))
    (stub / "inputs.py").write_text("def TokensPrompt(prompt_token_ids):\n    return {'prompt_token_ids': prompt_token_ids}\n")
    monkeypatch.setenv("PYTHONPATH", str(stub.parent))
    monkeypatch.setattr(interpreter, "VLLM_PYTHON", Path(sys.executable))
    rows, skipped = plain_rows.vllm_rows(tmp_path, [[5, 6, 7], [8, 9]], [0], 2, "float32", 1, tmp_path / "work")
    assert skipped == {}
    assert [(r["tokens"], r["token_ids"]) for r in rows[plain_rows.VLLM_ROW]] == [(2, [5, 6]), (2, [8, 9])]
