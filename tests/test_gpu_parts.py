"""Files that travel in parts (scripts/gpu/parts.py, docs/testing.md "The GPU run"): a folder
sent as parts comes back byte for byte, whatever order the parts arrive in; a part that is
missing is named with the call that sends it, one from a machine that went cold is said to be so,
and a corrupted part or joined file is refused in one line."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.subprocess  # runs the script as the device does

REPO = Path(__file__).resolve().parents[1]


def parts(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "scripts/gpu/parts.py"), *map(str, args)], capture_output=True, text=True, timeout=60)


@pytest.fixture
def sent(tmp_path):
    """A folder of three files (one in a subfolder) sent as parts of 1,000 bytes: (source, parts)."""
    source = tmp_path / "bundle"
    (source / "wheels").mkdir(parents=True)
    (source / "target.gguf").write_bytes(os.urandom(2500))
    (source / "wheels" / "a.whl").write_bytes(os.urandom(700))
    (source / "prompts.jsonl").write_text('{"id": 1, "prompt": "hi"}\n')
    out = parts("send", source, tmp_path / "parts", "--part-bytes", 1000)
    assert out.returncode == 0, out.stderr
    return source, tmp_path / "parts"


def files_of(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_parts_arriving_one_a_call_in_any_order_unpack_byte_for_byte(sent, tmp_path):
    source, made = sent
    manifest = json.loads((made / "manifest.json").read_text())
    names = [p["name"] for p in manifest["parts"]]
    assert len(names) >= 4 and all(p["bytes"] <= 1000 for p in manifest["parts"])
    device, dest = tmp_path / "device", tmp_path / "device-bundle"
    device.mkdir()
    for i, name in enumerate([names[1], names[0], *names[2:]]):  # the second part first
        (device / "manifest.json").write_bytes((made / "manifest.json").read_bytes())
        (device / name).write_bytes((made / name).read_bytes())
        out = parts("receive", device, dest)
        if i < len(names) - 1:
            assert out.returncode == 3, out.stdout + out.stderr
            assert not dest.exists()
    assert out.returncode == 0, out.stdout + out.stderr
    received = files_of(dest)
    assert received.pop("received.json") and received == files_of(source)
    again = parts("receive", device, dest)  # a warm machine called again: nothing to redo
    assert again.returncode == 0 and files_of(dest) == {**files_of(source), "received.json": (dest / "received.json").read_bytes()}


def test_a_missing_part_is_named_with_the_call_that_sends_it(sent):
    _, made = sent
    names = [p["name"] for p in json.loads((made / "manifest.json").read_text())["parts"]]
    (made / names[0]).unlink()  # sent earlier, gone with a machine that went cold
    out = parts("status", made)
    assert out.returncode == 3 and out.stderr == ""
    assert f"{len(names) - 1} of {len(names)} here and checked" in out.stdout
    assert f"{names[0]} is missing though a later part is here" in out.stdout
    assert f'next call: carry ["{made}/manifest.json", "{made}/{names[0]}"]' in out.stdout


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_corrupted_part_is_refused_in_one_line(sent, tmp_path, damage):
    _, made = sent
    name = json.loads((made / "manifest.json").read_text())["parts"][1]["name"]
    data = bytearray((made / name).read_bytes())
    if damage == "flip":
        data[17] ^= 1
    else:
        del data[-1]
    (made / name).write_bytes(bytes(data))
    out = parts("receive", made, tmp_path / "dest")
    assert out.returncode == 2 and not (tmp_path / "dest").exists()
    assert out.stderr.count("\n") == 1 and out.stderr.startswith(f"drafthead: error: {made}: {name}: ")
    assert ("sha256" if damage == "flip" else "999 bytes, the manifest says 1000") in out.stderr


def test_parts_that_join_into_another_file_are_refused(sent, tmp_path):
    _, made = sent
    manifest = json.loads((made / "manifest.json").read_text())
    manifest["sha256"] = "0" * 64  # every part checks, the whole does not
    (made / "manifest.json").write_text(json.dumps(manifest))
    out = parts("receive", made, tmp_path / "dest")
    assert out.returncode == 2 and out.stderr == "drafthead: error: bundle.tar: the joined parts' sha256 is not the manifest's\n"
    assert not (tmp_path / "dest").exists() and not list(tmp_path.glob("*.tar*"))


def test_no_manifest_is_one_line(tmp_path):
    out = parts("status", tmp_path)
    assert out.returncode == 2 and out.stderr.startswith("drafthead: error: no readable manifest") and out.stderr.count("\n") == 1
