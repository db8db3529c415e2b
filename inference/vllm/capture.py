"""The target's hidden states through vLLM's own `extract_hidden_states` path (CPU build), for
`data capture --backend vllm` (docs/models-and-data.md "Capturing through vLLM").

vLLM lives in its own venv (scripts/interop/setup_vllm.sh) and cannot share this process's torch,
so one child process of that venv's Python runs capture_child.py for the whole capture: the engine
starts once, each batch goes to it as token ids on stdin, and it answers with the files vLLM's
hidden-states connector wrote.

Ids: vLLM's `eagle_aux_hidden_state_layer_ids` count as our `output_hidden_states` indices do
(heads/config.py): id i is `hidden_states + residual` entering decoder layer i, 0 the embeddings.
At i = L (after the last layer) vLLM gives the *unnormed* output, while our index L is the final
*normed* state; so L is asked for as vLLM's L and the target's own final norm is applied here.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Callable, cast

import torch
from safetensors.torch import load_file

from ...ground.target.parts import decoder_of
from .interpreter import VLLM_PYTHON, child_env

CHILD = Path(__file__).with_name("capture_child.py")
VENV_ENV = "DRAFTHEAD_VLLM_VENV"  # the venv's folder, when --vllm-venv is not given
DEFAULT_VENV = VLLM_PYTHON.parents[1]  # .venv-interop/vllm under the repo root
# vLLM's KV cache and the hidden-states cache together: ~19k SmolLM2 fp32 tokens (55 KB each with 4 ids)
KV_CACHE_BYTES = 1 << 30
START_TIMEOUT_S = 1800  # engine start: model load and KV cache allocation


class VllmError(ValueError):
    """vLLM's venv is missing, its engine failed, or it answered something else than was asked: a
    ValueError, so the CLI says it in one line (drafthead/cli.py EXPECTED_ERRORS)."""


def vllm_layer_ids(layers, num_layers: int) -> list[int]:
    """Our `output_hidden_states` indices -> the `eagle_aux_hidden_state_layer_ids` to ask vLLM
    for: the same numbers, ascending and once each (the order of the columns vLLM writes); L is
    vLLM's unnormed last output, normed afterwards by `as_our_features`."""
    ids = sorted({int(i) for i in layers})
    bad = [i for i in ids if not 0 <= i <= num_layers]
    if bad:
        raise ValueError(
            f"hidden-state indices {bad}: vLLM's extract_hidden_states gives 0..{num_layers} "
            f"(the inputs of the {num_layers} decoder layers, and the last layer's output)"
        )
    return ids


def as_our_features(
    hidden: torch.Tensor, ids: list[int], layers, num_layers: int, final_norm: Callable[[torch.Tensor], torch.Tensor]
) -> dict[int, torch.Tensor]:
    """One prompt's vLLM file -> {layer: [T, H]}. hidden: [T, len(ids), H], column k holding id
    ids[k]; at L the unnormed output goes through the target's final norm (the LM head's input)."""
    out = {}
    for layer in layers:
        state = hidden[:, ids.index(layer)]
        if layer == num_layers:
            with torch.no_grad():
                state = final_norm(state)
        out[layer] = state
    return out


def final_norm_of(model) -> torch.nn.Module:
    """The norm between the target's last decoder layer and its LM head (`model.model.norm`)."""
    decoder = decoder_of(model)
    norm = getattr(decoder, "norm", None)
    if norm is None:
        raise ValueError(f"{type(model).__name__}: no final norm at get_decoder().norm, which --backend vllm applies to vLLM's unnormed last state")
    return norm


def venv_python(venv: str | Path | None) -> Path:
    """The Python of vLLM's venv: `venv`, else $DRAFTHEAD_VLLM_VENV, else DEFAULT_VENV."""
    folder = Path(venv or os.environ.get(VENV_ENV) or DEFAULT_VENV)
    python = folder / "bin" / "python"
    if not python.exists():
        raise VllmError(f"{folder}: no vLLM venv there (make one with scripts/interop/setup_vllm.sh, or point --vllm-venv / ${VENV_ENV} at one)")
    return python


class VllmTarget:
    """vLLM's forward of a target folder, for `capture_features(featurize=...)`.

    The child starts on the first `hidden_states` call, with the layers that call asks for; a
    later call must ask for the same. `work` (default: a new temporary folder) holds the spec, the
    child's log and vLLM's files.
    """

    def __init__(
        self,
        target_dir: str | Path,
        model,
        *,
        dtype: str,
        max_length: int,
        work: str | Path | None = None,
        venv: str | Path | None = None,
        threads: int = 1,
        kv_cache_bytes: int = KV_CACHE_BYTES,
    ):
        self.python = venv_python(venv)
        self.kv_cache_bytes = kv_cache_bytes
        self.work = Path(work) if work is not None else Path(tempfile.mkdtemp(prefix="drafthead-vllm-"))
        self.target_dir = Path(target_dir)
        self.dtype = dtype
        self.num_layers = model.config.get_text_config().num_hidden_layers
        self.final_norm = final_norm_of(model)
        self.feature_dtype = next(model.parameters()).dtype
        self.max_model_len = max_length + 1  # the prompt and the one token each request generates
        self.threads = threads
        self.ids: list[int] | None = None
        self.layers: tuple[int, ...] = ()
        self.child: subprocess.Popen | None = None
        self.log = self.work / "vllm.log"

    def _start(self, layers) -> None:
        self.ids = vllm_layer_ids(layers, self.num_layers)
        self.layers = tuple(layers)
        files = self.work / "hidden_states"
        files.mkdir(parents=True, exist_ok=True)
        spec = self.work / "vllm_capture_spec.json"
        spec.write_text(
            json.dumps(
                {
                    "target": str(self.target_dir),
                    "dtype": self.dtype,
                    "ids": self.ids,
                    "max_model_len": self.max_model_len,
                    "kv_cache_bytes": self.kv_cache_bytes,
                    "out": str(files),
                }
            )
        )
        # the connector is loaded by module name inside vLLM's worker: this folder goes on its path
        env = child_env(self.python, self.threads)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(CHILD.parent), env.get("PYTHONPATH")]))
        with open(self.log, "w") as log:
            self.child = subprocess.Popen(
                [str(self.python), str(CHILD), str(spec)], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True
            )
        self._answer("ready")

    def _answer(self, key: str):
        assert self.child is not None and self.child.stdout is not None  # started, with pipes (_start)
        line = self.child.stdout.readline()
        if not line:
            rc = self.child.wait()
            raise VllmError(f"vLLM failed (rc {rc}): {self._last_error()} (full log: {self.log})")
        return json.loads(line)[key]

    def _last_error(self) -> str:
        """The last line of vLLM's log that names an error, else its last line."""
        lines = [s.strip() for s in self.log.read_text(errors="replace").splitlines() if s.strip()]
        errors = [s for s in lines if "Error" in s or "error" in s]
        return (errors or lines or ["no output"])[-1]

    def hidden_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, layers: tuple[int, ...]) -> dict[int, torch.Tensor]:
        """{layer: [B, T, H]} HF `hidden_states[layer]` of every real token of right-padded rows,
        zero at padding (train/capture/features.py target_features gives the same from torch)."""
        if self.child is None:
            self._start(layers)
        elif tuple(layers) != self.layers:
            raise VllmError(f"the vLLM engine was started for layers {self.layers}, not {tuple(layers)}")
        B, T = input_ids.shape
        prompts = [input_ids[b, : int(attention_mask[b].sum())].tolist() for b in range(B)]
        assert self.child is not None and self.child.stdin is not None and self.ids is not None  # started above (_start)
        self.child.stdin.write(json.dumps({"prompts": prompts}) + "\n")
        self.child.stdin.flush()
        files = self._answer("files")
        H = cast(torch.Tensor, self.final_norm.weight).shape[-1]
        out = {layer: torch.zeros(B, T, H, dtype=self.feature_dtype) for layer in layers}
        for b, (ids, path) in enumerate(zip(prompts, files)):
            saved = load_file(path)
            os.remove(path)
            if saved["token_ids"].tolist() != ids:
                raise VllmError(f"{path}: vLLM saved the states of other tokens than row {b} of the batch")
            for layer, state in as_our_features(saved["hidden_states"], self.ids, layers, self.num_layers, self.final_norm).items():
                out[layer][b, : len(ids)] = state.to(self.feature_dtype)
        return out

    def close(self) -> None:
        """End the child: EOF on its stdin ends its loop."""
        if self.child is not None:
            assert self.child.stdin is not None  # started with pipes (_start)
            self.child.stdin.close()
            try:
                self.child.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.child.kill()
                self.child.wait()
            self.child = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
