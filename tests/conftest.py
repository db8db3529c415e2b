"""Shared fixtures: tiny random causal LMs (Llama, Qwen2, Mistral; built by tests/tiny.py) with the
tiny byte-level BPE tokenizer of drafthead.train.data.tiny (ChatML chat template), saved as Hugging Face
folders, as a user's local model would be.

Everything is built in-process (no hub): a tokenizer trained on a few strings, random weights.
"""

from __future__ import annotations

import fcntl
import os
import shutil
from pathlib import Path

import pytest
import torch

# The machine has 2 cores shared by everyone: never use more than 2 threads in tests.
torch.set_num_threads(min(2, torch.get_num_threads()))


def build_tiny_tokenizer(chat_template: bool = True):
    """The project's tiny byte-level BPE tokenizer (drafthead.train.data.tiny: ChatML template, EOS
    <|im_end|>; every string encodes and decodes back), optionally without its chat template."""
    from drafthead.train.data.tiny import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    if not chat_template:
        tokenizer.chat_template = None
    return tokenizer


def save_tiny_target(folder: Path, family: str = "llama", seed: int = 0, chat_template: bool = True, **overrides) -> Path:
    """Write a tiny model + tokenizer as a Hugging Face folder; returns the folder."""
    from tests.tiny import tiny_causal_lm  # the one tiny-model builder (docs/style.md 12)

    tokenizer = build_tiny_tokenizer(chat_template=chat_template)
    ids = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model = tiny_causal_lm(family, vocab=len(tokenizer), seed=seed, **{**ids, **overrides})
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return build_tiny_tokenizer()


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory):
    """Factory: family -> folder of a saved tiny random target (built once per test run)."""
    made: dict[tuple, Path] = {}

    def make(family: str = "llama", **overrides) -> Path:
        key = (family, tuple(sorted(overrides.items())))
        if key not in made:
            folder = tmp_path_factory.mktemp(f"tiny-{family}")
            made[key] = save_tiny_target(folder, family, **overrides)
        return made[key]

    return make


@pytest.fixture(scope="session")
def tiny_llama_dir(tiny_target_dir) -> Path:
    return tiny_target_dir("llama")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tiny_target_dir) -> Path:
    return tiny_target_dir("qwen2")


@pytest.fixture(scope="session")
def tiny_mistral_dir(tiny_target_dir) -> Path:
    return tiny_target_dir("mistral")


@pytest.fixture(scope="session")
def run_once(tmp_path_factory):
    """Factory: (name, make) -> a folder that make(folder) fills once for the whole test run, however
    many pytest-xdist workers ask for it (the first makes it, the others wait and read it): for
    results that cost a launch of gloo ranks, shared by tests that may run on either worker."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the run's folder: each worker's basetemp is a folder in it

    def once(name: str, make) -> Path:
        folder = root / f"once-{name}"
        with open(root / f"once-{name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            if not (folder / ".done").exists():
                shutil.rmtree(folder, ignore_errors=True)
                folder.mkdir()
                make(folder)
                (folder / ".done").touch()
        return folder

    return once


@pytest.fixture
def isolated_cache(tmp_path, monkeypatch) -> Path:
    """Point $DRAFTHEAD_CACHE at an empty temp folder."""
    folder = tmp_path / "cache"
    monkeypatch.setenv("DRAFTHEAD_CACHE", str(folder))
    return folder


def pytest_configure(config):
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# Modules holding the longest single tests and setups (10-35 s each on 2 cores: the GPU check's dry
# run, the gloo launches, SmolLM2's load, the statistical proofs). They run first, so that neither
# pytest-xdist worker is left with one of them at the end while the other idles. A hint for speed only.
LONG_FIRST = (
    "test_gpu_check",
    "test_distributed",
    "test_smollm2",
    "test_batch",
    "test_sampling_exactness",
    "test_multiprocess_data",
    "test_split_target",
    "test_shipped_head",
    "test_serve",
)


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: item.path.stem not in LONG_FIRST)  # stable: the order within each part stays


def save_tiny_vlm(folder: Path, seed: int = 0) -> Path:
    """A tiny Gemma-3 vision-language target folder with its own processor (Gemma3Processor: the
    tiny tokenizer plus begin/end-of-image and image tokens, a 28x28 image processor, 4 tokens per
    image), as `AutoProcessor` and `load_target` read a real one. Qwen-VL processors need
    torchvision for their video part, which the project does not install."""
    from transformers import AutoTokenizer, Gemma3ImageProcessorPil, Gemma3Processor

    from tests.tiny import tiny_gemma3_vlm

    names = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
    tokenizer = build_tiny_tokenizer()
    tokenizer.add_special_tokens({"extra_special_tokens": list(names.values())})  # ids V-3, V-2, V-1
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder, extra_special_tokens=names)  # named: boi_token_id, ...
    ids = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model = tiny_gemma3_vlm(vocab=len(tokenizer), seed=seed, **ids)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(folder)
    processor = Gemma3Processor(image_processor=Gemma3ImageProcessorPil(size={"height": 28, "width": 28}), tokenizer=tokenizer, image_seq_length=4)
    processor.save_pretrained(folder)
    return folder
