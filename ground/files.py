"""File helpers every layer uses: atomic writes (a temp file renamed into place, so a crash never
leaves half a file), reading JSON, safetensors and GGUF with one clear error per bad file, and
drafthead's cache folder."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from .outdir import reported_as, umask


class FileFormatError(ValueError):
    """A file that cannot be read as what it should be: missing, not JSON or not UTF-8, truncated
    or corrupt."""


# ----------------------------------------------------------------------------- atomic writes


def cache_root() -> Path:
    """drafthead's cache folder: $DRAFTHEAD_CACHE, default ~/.cache/drafthead (dequantized targets,
    tokenized data, kernel timings)."""
    env = os.environ.get("DRAFTHEAD_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "drafthead"


def _umask_mode() -> int:
    """The mode a plainly created file gets (0o666 less the umask); mkstemp would give 0o600."""
    return 0o666 & ~umask()


def atomic_write(path: Path, write) -> None:
    """write(tmp_path) then rename onto `path` (same directory, so the rename is atomic)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        with reported_as(path):
            write(tmp)
        os.chmod(tmp, _umask_mode())  # after writing: a writer may recreate the file
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_json(path: Path, obj: dict) -> None:
    def w(tmp):
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=2, sort_keys=False)
            f.write("\n")

    atomic_write(Path(path), w)


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata_: dict | None = None) -> None:
    # contiguous CPU copies: safetensors refuses views that share storage
    cpu = {k: v.detach().to("cpu").contiguous().clone() for k, v in tensors.items()}
    atomic_write(Path(path), lambda tmp: save_file(cpu, tmp, metadata=metadata_))


# ----------------------------------------------------------------------------- reading


def not_utf8(path, e: UnicodeDecodeError) -> ValueError:
    """The one-line error for a text file that is not UTF-8, naming the file and the byte."""
    return ValueError(
        f"{path} is not UTF-8 text (it holds the byte 0x{e.object[e.start]:02x}): save it as UTF-8, or check that it is the file you meant"
    )


def read_json(path: Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise FileFormatError(f"missing {path.name} in {path.parent}")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise FileFormatError(f"{path} is not valid JSON: {e}") from e
    except UnicodeDecodeError as e:
        raise FileFormatError(str(not_utf8(path, e))) from e
    if not isinstance(data, dict):
        raise FileFormatError(f"{path} holds a JSON {type(data).__name__}, not an object: check that it is the file you meant")
    return data


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    path = Path(path)
    if not path.is_file():
        raise FileFormatError(f"missing weights file {path.name} in {path.parent}")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise FileFormatError(f"{path} is truncated or corrupt: {e}") from e


def read_gguf(path: Path):
    """A gguf.GGUFReader over the file at `path`, checked whole: a file cut inside its header
    or its tensor data (or not GGUF at all) is one FileFormatError saying so, instead of the
    reader's struct / reshape errors."""
    from gguf import GGUFReader

    path = Path(path)
    size = path.stat().st_size
    advice = "copy or download it again"
    try:
        reader = GGUFReader(str(path))
    # the reader meets a short file as whatever numpy or struct raises first (ValueError,
    # IndexError, struct.error...): any failure to parse is reported the same way
    except Exception as e:
        raise FileFormatError(f"{path} is truncated or not a GGUF file ({size} bytes; the reader says: {' '.join(str(e).split())}): {advice}") from e
    end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
    if end > size:
        raise FileFormatError(f"{path} is truncated: its tensors end at byte {end}, the file has {size}: {advice}")
    return reader
