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

Two processes never write one output: `output_lock(out)` (which `fresh_folder` takes itself) is
held for the whole write, and a second command asking for the same output is refused. Under that
lock, temp files and folders beside the output are leftovers of a killed run, and are removed.
--overwrite never deletes what a command reads or what no drafthead command wrote
(`check_replaceable`): every folder a command writes holds a marker (MARKER_FILE) naming what
wrote it and its files, a file output is recognised by its command (a regeneration's records),
and anything else is refused, naming a file --overwrite would delete.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import fnmatch
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Iterable, Iterator

OVERWRITE_FLAG = "--overwrite"


class OutputExistsError(ValueError):
    """The output folder (or file) holds something this command would replace."""


def is_empty(path: str | os.PathLike) -> bool:
    """True when `path` is missing, an empty file or a folder holding nothing but its marker
    (MARKER_FILE: a command that stopped before it wrote anything)."""
    path = Path(path)
    if not path.exists():
        return True
    if path.is_dir():
        return all(p.name == MARKER_FILE for p in path.iterdir())
    return path.stat().st_size == 0


def check_output(
    path: str | os.PathLike, *, overwrite: bool, what: str = "output", own: Callable[[Path], bool] | None = None, hint: str = ""
) -> None:
    """Raise OutputExistsError when `path` holds something and `overwrite` is off. own(path): True
    for the command's own resumable work (a capture's shards, a regeneration's records), which it
    may continue. hint: words after "is not empty" saying why it cannot be continued."""
    check_parents(path, what)
    if overwrite or is_empty(path) or (own is not None and own(Path(path))):
        return
    raise OutputExistsError(f"{what} {path} is not empty{hint}: pass {OVERWRITE_FLAG} to replace it, or choose another path")


def check_parents(path: str | os.PathLike, what: str = "output") -> None:
    """Refuse an output under a file (`--out notes.txt/sub`): mkdir would say only "File exists"."""
    for parent in Path(path).absolute().parents:
        if parent.exists():
            if not parent.is_dir():
                raise OutputExistsError(f"{what} {path}: {parent} is a file, not a folder: choose another path")
            return


# Every folder a drafthead command writes holds this file: what wrote it and the files it writes
# there (paths relative to the folder; fnmatch patterns for an output that grows, a run's
# checkpoints). --overwrite deletes a folder only when every file in it is one of those.
MARKER_FILE = "drafthead-output.json"
# Files any output may hold that lose nothing when deleted: what this module's writes leave
# inside an output while they run (fresh_folder's temp and old folders, atomic writes' temp files,
# output_lock's lock file), and what file browsers leave in a folder they showed
_DISPOSABLE = (".*.tmp", ".*.lock", ".*.old-*", ".DS_Store", "Thumbs.db", "desktop.ini")


def mark_output(folder: str | os.PathLike, what: str, files: Iterable[str]) -> None:
    """Write `folder`'s MARKER_FILE: `what` wrote it, and `files` (relative paths or patterns) are
    its own. Replaces the marker whole (a temp file renamed in); a failed write names it."""
    marker = Path(folder) / MARKER_FILE
    body = json.dumps({"output": what, "files": sorted(set(files))}, indent=1) + "\n"
    with reported_as(marker):
        fd, tmp = tempfile.mkstemp(prefix=f".{MARKER_FILE}.", suffix=".tmp", dir=marker.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(body)
            os.chmod(tmp, 0o666 & ~umask())
            os.replace(tmp, marker)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise


def marked_files(folder: Path) -> list[str]:
    """The files `folder`'s marker names as its command's ([] without a readable marker)."""
    try:
        files = json.loads((folder / MARKER_FILE).read_text(encoding="utf-8")).get("files")
    except (OSError, ValueError, AttributeError):
        return []
    return [f for f in files if isinstance(f, str)] if isinstance(files, list) else []


def files_under(folder: Path) -> list[str]:
    """Every file (and symlink) under `folder`, as sorted relative POSIX paths; symlinks are not
    followed (deleting one deletes the link, but it is listed like a file)."""
    found = []
    for root, dirs, files in os.walk(folder):
        here = Path(root)
        found += [(here / name).relative_to(folder).as_posix() for name in files]
        found += [(here / name).relative_to(folder).as_posix() for name in dirs if (here / name).is_symlink()]
    return sorted(found)


def foreign_files(folder: Path) -> list[str]:
    """The files under `folder` (relative paths, sorted) that no drafthead command wrote: those
    its marker does not name (every file, without a marker), less the _DISPOSABLE ones.
    A subfolder holding its own marker (a run's final/ head) is judged by that marker."""
    own = [MARKER_FILE, *marked_files(folder)]

    def ours(name: str) -> bool:
        return any(name == p or fnmatch.fnmatchcase(name, p) for p in own) or any(
            fnmatch.fnmatchcase(name.rsplit("/", 1)[-1], p) for p in _DISPOSABLE
        )

    found = []
    for root, dirs, files in os.walk(folder):
        here = Path(root)
        for name in list(dirs):
            sub = here / name
            if sub.is_symlink():
                files.append(name)  # listed, not followed
            elif (sub / MARKER_FILE).is_file():
                dirs.remove(name)
                found += [f"{sub.relative_to(folder).as_posix()}/{inner}" for inner in foreign_files(sub)]
        found += [rel for rel in ((here / name).relative_to(folder).as_posix() for name in files) if not ours(rel)]
    return sorted(found)


def check_replaceable(path: str | os.PathLike, *, inputs=(), what: str = "output", own: Callable[[Path], bool] | None = None) -> None:
    """Refuse --overwrite of `path` when deleting it would lose what the command reads or what no
    drafthead command wrote: one of `inputs` (the source, the target, the data, the config; None
    skipped) is `path` or lies inside it; or `path` is a file that own(path) does not claim as
    this command's (a file output: its own records), or a folder holding a file its
    MARKER_FILE does not name."""
    path = Path(path)
    if is_empty(path):
        return
    here = path.resolve()
    for name in inputs:
        if name is None or not Path(name).exists():
            continue  # a hub id or a built-in name: not on disk under `path`
        src = Path(name).resolve()
        if src == here or here in src.parents:
            relation = "is" if src == here else "holds"
            raise OutputExistsError(f"{what} {path} {relation} this command's input {name}: {OVERWRITE_FLAG} would delete it; choose another path")
    if not path.is_dir() or path.is_symlink():
        if own is not None and own(path):
            return
        raise OutputExistsError(
            f"{what} {path} is a file that no drafthead command wrote there: {OVERWRITE_FLAG} would delete it; choose another path"
        )
    foreign = foreign_files(path)
    if foreign:
        more = f" and {len(foreign) - 1} more file{'s' * (len(foreign) > 2)}" if len(foreign) > 1 else ""
        raise OutputExistsError(
            f"{what} {path} holds {foreign[0]}{more} that no drafthead command wrote there: "
            f"{OVERWRITE_FLAG} would delete it; move it out or choose another path"
        )


class OutputLockedError(OutputExistsError):
    """Another process is writing the same output."""


def lock_file(path: str | os.PathLike) -> Path:
    """The lock of output `path`: a hidden file beside it (the output itself may not exist yet,
    and is renamed or cleared while it is written)."""
    path = Path(path).absolute()
    return path.parent / f".{path.name}.lock"


@contextlib.contextmanager
def output_lock(path: str | os.PathLike, *, enabled: bool = True) -> Iterator[None]:
    """Hold an exclusive lock on output `path` for the block; raise OutputLockedError at once when
    another process holds it (flock: released by the kernel when a holder dies, so a killed run
    never leaves a stale lock). enabled False: nothing (the processes of one launch other than
    the main one, which holds the lock for all of them)."""
    if not enabled:
        yield
        return
    file = lock_file(path)
    check_parents(file.parent, "output")
    file.parent.mkdir(parents=True, exist_ok=True)
    while True:
        fd = os.open(file, os.O_RDWR | os.O_CREAT, 0o666 & ~umask())
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise OutputLockedError(
                f"{path} is being written by another drafthead process (pid {holder}): wait for it to finish, or choose another path"
            ) from None
        # the holder before us unlinks the file as it lets go: a lock on that unlinked file
        # guards nothing, so lock the file that is there now
        try:
            same = os.fstat(fd).st_ino == os.stat(file).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    try:
        with contextlib.suppress(OSError):  # the pid only informs a refused writer; a full disk has no room for it
            os.ftruncate(fd, 0)
            os.write(fd, str(os.getpid()).encode())
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(file)
        os.close(fd)


def remove_leftovers(path: str | os.PathLike) -> list[Path]:
    """Delete the temp files and folders a killed write of output `path` left beside it
    (`.{name}.*.tmp`, from fresh_folder and ground/files.py's atomic_write); call it holding
    output_lock(path), which makes every such temp a leftover. Returns what was removed."""
    path = Path(path).absolute()
    if not path.parent.is_dir():
        return []
    gone = sorted(path.parent.glob(f".{glob_escape(path.name)}.*.tmp"))
    for p in gone:
        clear_output(p)
    return gone


def glob_escape(name: str) -> str:
    """`name` matched literally by Path.glob ([, ], * and ? in a user's folder name)."""
    import glob

    return glob.escape(name)


def probe_writable(folder: str | os.PathLike) -> None:
    """Create `folder` (with its missing parents) and a file in it, then remove what was made: a
    folder that cannot be written fails now, before the work, with the OSError naming it."""
    folder = Path(folder).absolute()
    made = []  # innermost first
    p = folder
    while not p.exists():
        made.append(p)
        p = p.parent
    try:
        for d in reversed(made):
            os.mkdir(d)
        fd, name = tempfile.mkstemp(prefix=".probe-", dir=folder)
        os.close(fd)
        os.unlink(name)
    finally:
        for d in made:
            with contextlib.suppress(OSError):
                os.rmdir(d)


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

    An existing non-empty `path` is refused unless `overwrite`, and then unless a drafthead
    command wrote it (check_replaceable); with it, the old folder is renamed away, the new one
    renamed in, then the old one deleted (two renames in one directory: a crash between them
    leaves the old folder under `.{name}.old-*`, never a mix). The new folder's MARKER_FILE names
    every file in it, `what` wrote it. On any exception (KeyboardInterrupt included) the temp
    folder is removed and `path` is untouched.
    """
    path = Path(path)
    check_output(path, overwrite=overwrite, what=what)
    if overwrite:
        check_replaceable(path, what=what)
    with output_lock(path):
        remove_leftovers(path)
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
        os.chmod(tmp, 0o777 & ~umask())  # mkdtemp gives 0o700; the folder should read like any other
        try:
            with reported_as(path):
                yield tmp
                mark_output(tmp, what, files_under(tmp))
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


# What writers say when the disk fills: safetensors "... (os error 28)", torch.save a short
# write ("unexpected pos N vs M", "PytorchStreamWriter failed writing"), which names no cause
_OS_ERROR_CODE = re.compile(r"os error (\d+)")
_SHORT_WRITE = ("unexpected pos", "PytorchStreamWriter failed writing")
# Below this much free space, a short write is taken for a full disk (a checkpoint or shard
# needs far more than this; a disk with more free than this failed for another reason)
FULL_DISK_BYTES = 16 << 20


def write_failure(e: BaseException, path: str | os.PathLike) -> OSError | None:
    """The OSError, naming `path`, that a writer's error stands for; None when `e` is no write
    failure. An OSError without a file name gets `path`; safetensors' and torch's errors carry
    the system's error code in their text, or (torch) only say the write stopped short."""
    if isinstance(e, OSError):
        return e if e.filename is not None else OSError(e.errno, e.strerror or str(e), str(path))
    text = str(e)
    code = _OS_ERROR_CODE.search(text)
    if code is not None:
        number = int(code.group(1))
        return OSError(number, os.strerror(number), str(path))
    if any(s in text for s in _SHORT_WRITE):
        if free_bytes(path) < FULL_DISK_BYTES:
            return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return OSError(errno.EIO, f"the write stopped short ({' '.join(text.split())[:120]})", str(path))
    return None


def free_bytes(path: str | os.PathLike) -> int:
    """Free bytes on the file system that holds `path` (or its nearest existing parent)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


@contextlib.contextmanager
def reported_as(path: str | os.PathLike) -> Iterator[None]:
    """Errors of the writes in the block as OSErrors naming `path` (write_failure), which the CLI
    prints as one line with what to do (drafthead/cli.py OS_ERROR_HINTS: a full disk's hint)."""
    try:
        yield
    except Exception as e:  # SafetensorError derives from Exception alone
        writer = isinstance(e, (OSError, RuntimeError)) or type(e).__name__ == "SafetensorError"
        failure = write_failure(e, path) if writer else None
        if failure is None or failure is e:
            raise
        raise failure from e


def umask() -> int:
    """The process's umask (read by setting and restoring it)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask
