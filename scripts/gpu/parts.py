"""Files that travel in parts (docs/testing.md "The GPU run"). The device tool carries at most
64 MiB a call, the checkout included, and brings back files of at most 16 MiB; the GPU run's
bundle (the target's GGUF, wheels, prompts) and the head it trains are larger. A file is split
into numbered parts and a manifest holding each part's sha256 and the whole file's; the side that
receives them checks each part as it comes, says which are missing, and joins them once all are
there. Standard library only: it runs on the device before anything is installed.

    python3 scripts/gpu/parts.py send SOURCE PARTS --part-bytes N   a folder (as a tar) or a file into parts
    python3 scripts/gpu/parts.py status PARTS          which parts PARTS holds, checked, and what to send next
    python3 scripts/gpu/parts.py receive PARTS DEST    status; once every part is there, join and unpack into DEST

A folder travels as an uncompressed tar (what it holds is compressed already, or small).
Exit status of `receive`: 0 when DEST is complete, 3 while parts are missing, 2 for a part or
file that fails its check (one line: `drafthead: error: ...`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tarfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

MANIFEST = "manifest.json"
INCOMPLETE = 3  # receive's exit status while parts are missing
DONE = "received.json"  # in DEST: the manifest of the file DEST was unpacked from


class PartsError(ValueError):
    """A part or a joined file that fails its check, or parts that cannot be joined yet."""


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_json(path: Path, record: dict) -> None:
    """Atomically: a reader never sees half a manifest."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    os.replace(tmp, path)


def split(file: Path, folder: Path, part_bytes: int) -> dict:
    """`file` as parts of at most `part_bytes` in `folder` (`<name>.partNN`) and its manifest;
    returns the manifest. Parts of an earlier split of another file are removed first."""
    if part_bytes < 1:
        raise PartsError(f"parts must hold at least one byte, got {part_bytes}")
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("*.part*"):
        old.unlink()
    parts = []
    with open(file, "rb") as f:
        while block := f.read(part_bytes):
            name = f"{file.name}.part{len(parts):02d}"
            (folder / name).write_bytes(block)
            parts.append({"name": name, "bytes": len(block), "sha256": hashlib.sha256(block).hexdigest()})
    manifest = {"file": file.name, "bytes": file.stat().st_size, "sha256": sha256_of(file), "part_bytes": part_bytes, "parts": parts}
    write_json(folder / MANIFEST, manifest)
    return manifest


def pack(folder: Path, tar_path: Path) -> Path:
    """`folder`'s files as an uncompressed tar (sorted names, no owners or times: the same folder
    gives the same bytes)."""

    def plain(info: tarfile.TarInfo) -> tarfile.TarInfo:
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        info.mtime = 0
        return info

    with tarfile.open(tar_path, "w") as tar:
        for path in sorted(p for p in folder.rglob("*") if p.is_file()):
            tar.add(path, arcname=str(path.relative_to(folder)), filter=plain)
    return tar_path


@dataclass
class Status:
    """What a parts folder holds against its manifest."""

    manifest: dict
    good: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    bad: list[str] = field(default_factory=list)  # "name: why"

    @property
    def complete(self) -> bool:
        return not self.missing and not self.bad

    def report(self, folder: str) -> str:
        """Lines for the person sending the parts: what is here, what is wrong, what to send next."""
        total = len(self.manifest["parts"])
        here = f" ({', '.join(self.good)})" if self.good else ""
        lines = [f"parts of {self.manifest['file']}: {len(self.good)} of {total} here and checked{here}"]
        lines += [f"part refused: {why}" for why in self.bad]
        if self.complete:
            return "\n".join(lines)
        names = [p["name"] for p in self.manifest["parts"]]
        todo = [name for name in names if name not in self.good]
        if self.good and names.index(todo[0]) < names.index(self.good[-1]):
            lines.append(f"{todo[0]} is missing though a later part is here: sent before, it went with a machine that went cold")
        lines.append(f"missing: {', '.join(todo)}")
        lines.append(f'next call: carry ["{folder}/{MANIFEST}", "{folder}/{todo[0]}"]')
        return "\n".join(lines)


def send(source: Path, folder: Path, part_bytes: int) -> dict:
    """A folder (packed into a tar beside the parts, then removed) or a file, split into `folder`."""
    if not source.exists():
        raise PartsError(f"nothing at {source}")
    if not source.is_dir():
        return split(source, folder, part_bytes)
    folder.mkdir(parents=True, exist_ok=True)
    tar = pack(source, folder / f"{source.name}.tar")
    try:
        return split(tar, folder, part_bytes)
    finally:
        tar.unlink()


def status(folder: Path) -> Status:
    manifest_path = folder / MANIFEST
    try:
        manifest = json.loads(manifest_path.read_text())
        parts = manifest["parts"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise PartsError(f"no readable manifest at {manifest_path} ({e.__class__.__name__}): carry it with every part") from None
    state = Status(manifest)
    for part in parts:
        path = folder / part["name"]
        if not path.is_file():
            state.missing.append(part["name"])
        elif path.stat().st_size != part["bytes"]:
            state.bad.append(f"{part['name']}: {path.stat().st_size} bytes, the manifest says {part['bytes']}")
        elif sha256_of(path) != part["sha256"]:
            state.bad.append(f"{part['name']}: its sha256 is not the manifest's")
        else:
            state.good.append(part["name"])
    return state


def join(folder: Path, out: Path) -> Path:
    """Every part of `folder`, checked, joined into `out` (atomically), the whole checked too."""
    state = status(folder)
    if state.bad:
        raise PartsError(f"{folder}: {state.bad[0]}; send it again")
    if state.missing:
        raise PartsError(f"{folder}: {len(state.missing)} of {len(state.manifest['parts'])} parts missing, the first {state.missing[0]}")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    with open(tmp, "wb") as f:
        for part in state.manifest["parts"]:
            with open(folder / part["name"], "rb") as src:
                shutil.copyfileobj(src, f)
    if sha256_of(tmp) != state.manifest["sha256"]:
        tmp.unlink()
        raise PartsError(f"{out.name}: the joined parts' sha256 is not the manifest's")
    os.replace(tmp, out)
    return out


def unpack(tar_path: Path, dest: Path, manifest: dict) -> None:
    """The tar's files into `dest`, replacing what it held, then DONE beside them."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    with tarfile.open(tar_path) as tar:
        tar.extractall(tmp, filter="data")
    write_json(tmp / DONE, manifest)
    if dest.exists():
        shutil.rmtree(dest)
    os.replace(tmp, dest)


def receive(folder: Path, dest: Path) -> Status:
    """status(folder); once every part is there, the tar they make unpacked into `dest` (nothing
    to do when `dest` already holds this manifest's file: a warm machine called again)."""
    state = status(folder)
    if not state.complete:
        return state
    done = dest / DONE
    if done.is_file() and json.loads(done.read_text()).get("sha256") == state.manifest["sha256"]:
        return state
    dest.parent.mkdir(parents=True, exist_ok=True)
    tar_path = join(folder, dest.parent / state.manifest["file"])
    unpack(tar_path, dest, state.manifest)
    tar_path.unlink()
    return state


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    out = sub.add_parser("send")
    out.add_argument("source")
    out.add_argument("parts")
    out.add_argument("--part-bytes", type=int, required=True)
    sub.add_parser("status").add_argument("parts")
    got = sub.add_parser("receive")
    got.add_argument("parts")
    got.add_argument("dest")
    args = p.parse_args(argv)
    if args.command != "send":
        return checked(args.parts, None if args.command == "status" else args.dest)
    try:
        manifest = send(Path(args.source), Path(args.parts), args.part_bytes)
    except PartsError as e:
        print(f"drafthead: error: {e}", file=sys.stderr)
        return 2
    print(f"{args.parts}: {manifest['file']}, {manifest['bytes']} bytes in {len(manifest['parts'])} parts")
    return 0


def checked(parts: str, dest: str | None) -> int:
    """status(parts), or with `dest` receive(parts, dest), reported for the person sending them;
    returns the exit status (module docstring)."""
    try:
        state = status(Path(parts)) if dest is None else receive(Path(parts), Path(dest))
    except PartsError as e:
        print(f"drafthead: error: {e}", file=sys.stderr)
        return 2
    print(state.report(parts))
    if state.bad:
        print(f"drafthead: error: {parts}: {state.bad[0]}; send it again", file=sys.stderr)
        return 2
    if not state.complete:
        return INCOMPLETE
    if dest is not None:
        print(f"received: {dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
