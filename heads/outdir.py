"""Output folders that appear whole or not at all, and never replace a user's files silently.

Every command that writes an output (train's output_dir, export, import, data capture and
regenerate, the tiny target) goes through here (docs/reliability.md):

    check_output(out, overwrite=args.overwrite)        # refuse a non-empty folder up front
    with fresh_folder(out, overwrite=...) as tmp:      # write into tmp, a sibling of out
        ...                                            # on success tmp is renamed onto out

A folder is "empty" when it does not exist or holds nothing. Anything else is the user's and is
refused unless they pass --overwrite; then the old folder is swapped out only after the new one is
complete, so stale files never mix with new ones and an interruption (Ctrl-C, a crash, a full
disk) leaves the old folder as it was and no half-written one under the asked-for name.

Outputs that are resumable in place (a training run, a capture, a regeneration) are written
under their own name, so a rerun finds them: `check_output(..., own=...)` lets the command
continue its own work, and under --overwrite `clear_output` deletes the old one first.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Iterator

OVERWRITE_FLAG = "--overwrite"


class OutputExistsError(ValueError):
    """The output folder (or file) holds something this command would replace."""


def is_empty(path: str | os.PathLike) -> bool:
    """True when `path` is missing, an empty folder or an empty file."""
    path = Path(path)
    if not path.exists():
        return True
    if path.is_dir():
        return not any(path.iterdir())
    return path.stat().st_size == 0


def check_output(path: str | os.PathLike, *, overwrite: bool, what: str = "output", own: Callable[[Path], bool] | None = None,
                 hint: str = "") -> None:
    """Raise OutputExistsError when `path` holds something and `overwrite` is off. own(path): True
    for the command's own resumable work (a capture's shards, a regeneration's records), which it
    may continue. hint: words after "is not empty" saying why it cannot be continued."""
    if overwrite or is_empty(path) or (own is not None and own(Path(path))):
        return
    raise OutputExistsError(f"{what} {path} is not empty{hint}: pass {OVERWRITE_FLAG} to replace it, or choose another path")


def check_distinct(src: str | os.PathLike, out: str | os.PathLike, what: str = "--out") -> None:
    """Refuse writing a conversion over its own source (its original layout would be lost)."""
    if Path(out).resolve() == Path(src).resolve():
        raise OutputExistsError(f"{what} {out} is the source folder itself: write to another folder")


def clear_output(path: str | os.PathLike) -> None:
    """Delete the file or folder at `path` (nothing there: nothing to do). For the outputs that are
    their own resumable work (a training run, a capture, a regeneration): they live under their
    own name while being written, so `--overwrite` clears the old one when the command starts."""
    path = Path(path)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


@contextlib.contextmanager
def fresh_folder(path: str | os.PathLike, *, overwrite: bool = False, what: str = "output") -> Iterator[Path]:
    """Yield an empty temp folder beside `path`; when the block ends normally, it becomes `path`.

    An existing non-empty `path` is refused unless `overwrite`; with it, the old folder is renamed
    away, the new one renamed in, then the old one deleted (two renames in one directory: a crash
    between them leaves the old folder under `.{name}.old-*`, never a mix). On any exception
    (KeyboardInterrupt included) the temp folder is removed and `path` is untouched.
    """
    path = Path(path)
    check_output(path, overwrite=overwrite, what=what)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    os.chmod(tmp, 0o777 & ~umask())  # mkdtemp gives 0o700; the folder should read like any other
    try:
        yield tmp
        _swap_in(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _swap_in(new: Path, path: Path) -> None:
    """Rename `new` onto `path`, replacing what is there (a file or a folder)."""
    if not path.exists() and not path.is_symlink():
        os.rename(new, path)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{path.name}.old-", dir=path.parent))
    old.rmdir()  # only the unique name is wanted
    os.rename(path, old)
    try:
        os.rename(new, path)
    except BaseException:
        os.rename(old, path)  # put the user's folder back
        raise
    clear_output(old)


def umask() -> int:
    """The process's umask (read by setting and restoring it)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask
