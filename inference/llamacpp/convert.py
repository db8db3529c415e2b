"""A transformers target as a GGUF for the llama.cpp backend, made by llama.cpp's own tools:
its converter (convert_hf_to_gguf.py, copied beside libllama by scripts/setup_libllama.sh) writes
f32 or bf16, and its quantizer (llama_model_quantize, through the shim) makes q8_0 / q4_0 from
the f32 file. Each file is made once per target folder and type, into a cache folder, and made
again when the target's weights are newer (docs/llamacpp-backend.md).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

from ...ground.files import cache_root
from . import lib as _lib

# GGUF type -> llama.h `enum llama_ftype` for the quantizer (None: the converter writes it)
GGUF_TYPES = {"f32": None, "bf16": None, "q8_0": 7, "q4_0": 2}
DTYPE_GGUF = {"float32": "f32", "bfloat16": "bf16"}  # the GGUF holding a torch dtype's weights


class ConversionError(RuntimeError):
    """llama.cpp's converter or quantizer failed on the target."""


def cache_dir() -> Path:
    return cache_root() / "gguf"


def converter() -> Path:
    path = _lib.library_dir().parent / "converter" / "convert_hf_to_gguf.py"
    if not path.is_file():
        raise _lib.LibllamaMissing(f"llama.cpp's converter is not at {path} (run `make llamacpp`)")
    return path


def target_gguf(folder: str | Path, gguf_type: str, out_dir: Path | None = None) -> Path:
    """The GGUF of the transformers model in `folder` with weights of `gguf_type`, made if needed."""
    if gguf_type not in GGUF_TYPES:
        raise ValueError(f"GGUF type {gguf_type!r}: choose one of {', '.join(GGUF_TYPES)}")
    folder = Path(folder).resolve()
    weights = sorted(folder.glob("*.safetensors")) + sorted(folder.glob("*.bin"))
    if not weights:
        raise FileNotFoundError(f"{folder}: no model weights to convert")
    key = hashlib.sha256(str(folder).encode()).hexdigest()[:12]
    out_dir = out_dir or cache_dir()
    out = out_dir / f"{folder.name}-{key}.{gguf_type}.gguf"
    newest = max(w.stat().st_mtime for w in weights)
    if out.is_file() and out.stat().st_mtime >= newest:
        return out
    out_dir.mkdir(parents=True, exist_ok=True)
    ftype = GGUF_TYPES[gguf_type]
    if ftype is None:
        _convert(folder, out, gguf_type)
    else:
        source = target_gguf(folder, "f32", out_dir)
        tmp = out.with_suffix(".tmp")
        rc = _lib.load().dh_quantize(str(source).encode(), str(tmp).encode(), ftype, os.cpu_count() or 1)
        if rc != 0:
            tmp.unlink(missing_ok=True)
            raise ConversionError(f"llama.cpp's quantizer failed ({rc}) making {gguf_type} from {source}")
        tmp.replace(out)
    return out


def _convert(folder: Path, out: Path, gguf_type: str) -> None:
    tmp = out.with_suffix(".tmp")
    cmd = [sys.executable, str(converter()), str(folder), "--outtype", gguf_type, "--outfile", str(tmp)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        tmp.unlink(missing_ok=True)
        tail = "\n".join(done.stderr.strip().splitlines()[-5:])
        raise ConversionError(f"llama.cpp's converter failed on {folder} (rc {done.returncode}):\n{tail}")
    tmp.replace(out)
