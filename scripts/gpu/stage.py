"""Stage what a device call carries into a git-ignored folder (docs/testing.md "On a GPU").

    .venv/bin/python scripts/gpu/stage.py --out .gpu      the GPU check's folder, one call (scripts/gpu/check.sh)
    .venv/bin/python scripts/gpu/stage.py --run           the GPU run's bundle, in parts (scripts/gpu/run.sh)

The check's folder: the SmolLM2-135M target's config and tokenizer (no weights: the check builds a
target of its shapes with random weights), 256 ShareGPT chats, 8 MT-bench prompts, and (unless
--no-wheels) the wheels of the packages drafthead needs that the GPU image lacks or holds at
other versions. SmolLM2-135M's weights are 270 MB in bf16, four times what one call may carry; speed
and memory depend on the target's shapes, not its values.

The GPU run's bundle holds the real target: the built-in target's own GGUF file (Q4_1, 94 MiB),
the smallest exact form of its weights, since the target *is* that file dequantized (the fp32
safetensors it becomes are 513 MiB, bf16 would round it); the device dequantizes it as this
machine did and compares the weights' digest with this machine's. Beside it the wheels, the user
turns of ShareGPT conversations for the target to answer, and MT-bench prompts. The bundle is one
tar split into parts that each fit a call beside the checkout (scripts/gpu/parts.py); the script
prints the calls.
"""

from __future__ import annotations

import argparse
import json
import lzma
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from parts import MANIFEST, send, sha256_of  # noqa: E402  (a sibling script)

# the packages drafthead needs at versions the GPU image lacks (docs/testing.md "On a GPU"): their
# dependency closure is downloaded, less what the image holds at versions that satisfy it or what
# is too large to carry (pyarrow: 55 MB; the image's is used). Installed there offline, resolved
# against the image's own packages (its tokenizers 0.23.2 caps huggingface_hub below 2.0, so
# tokenizers travels too). wandb stays behind (22 MB; the check logs with report_to=none).
WANTED = ("transformers==5.25.0", "huggingface_hub==2.4.0", "datasets==5.2.0", "gguf==0.19.0")
IMAGE_HAS = {
    "numpy",
    "pandas",
    "pyarrow",
    "safetensors",
    "typer",
    "pydantic",
    "pydantic_core",
    "rich",
    "pygments",
    "markdown_it_py",
    "mdurl",
    "shellingham",
    "annotated_doc",
    "annotated_types",
    "typing_inspection",
    "torch",
    "triton",
    "sympy",
    "networkx",
    "jinja2",
    "markupsafe",
    "mpmath",
}
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in (17, 24, 27, 28, 31, 34, 35)] + ["manylinux2014_x86_64", "manylinux1_x86_64"]


CALL_BYTES = 64 * 2**20  # what one device call carries, the checkout included (docs/testing.md)
SPARE_BYTES = 2**20  # kept free in every call: the manifest, and files the checkout gains
GPU_RUN = Path(".gpu-run")  # the GPU run's folder, relative to the repository root
MAX_PROMPT_TOKENS = 384  # a longer user turn is left out, as the shipped head's data did (heads/pretrained/README.md)
MAX_TURNS = 3  # user turns a conversation keeps: the target answers each in turn, its answers in the history


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="default: .gpu, with --run .gpu-run")
    p.add_argument("--run", action="store_true", help="the GPU run's bundle in parts (module docstring)")
    p.add_argument("--chats", type=int, default=256, help="the check's ShareGPT chats")
    p.add_argument("--conversations", type=int, default=None, help="the GPU run's ShareGPT conversations to answer (default: all that qualify)")
    p.add_argument("--no-wheels", action="store_true", help="the CPU dry run: its venv has every package")
    p.add_argument("--python-version", default="3.12", help="the GPU image's Python (docs/testing.md)")
    args = p.parse_args(argv)
    if args.run:
        return stage_run(Path(args.out or GPU_RUN), args)
    return stage_check(Path(args.out or ".gpu"), args)


def stage_check(out: Path, args) -> int:
    from drafthead.inference.bench.prompts import load_prompts
    from drafthead.ground.target.load import target_folder
    from drafthead.train.data.sources import sharegpt_chats

    (out / "smollm2").mkdir(parents=True, exist_ok=True)
    folder, _ = target_folder("smollm2-135m")
    for file in folder.iterdir():  # config, tokenizer and chat template; not the weights
        if file.is_file() and file.suffix != ".safetensors" and not file.name.startswith("drafthead_"):
            shutil.copy(file, out / "smollm2" / file.name)
    chats = sharegpt_chats(args.chats)
    with open(out / "chats.jsonl", "w", encoding="utf-8") as f:
        for chat in chats:
            f.write(json.dumps({"id": chat["id"], "messages": chat["messages"]}, ensure_ascii=False) + "\n")
    with open(out / "prompts.jsonl", "w", encoding="utf-8") as f:
        for prompt in load_prompts("mt-bench", 8):
            f.write(json.dumps({"id": prompt.id, "prompt": prompt.text}) + "\n")
    if not args.no_wheels:
        stage_wheels(out / "wheels", args.python_version)
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(f"staged {out}: {size / 2**20:.1f} MiB")
    return 0


def stage_run(out: Path, args) -> int:
    """The bundle (module docstring) as parts in out/parts; prints the device calls that carry them."""
    from drafthead.inference.bench.prompts import load_prompts
    from drafthead.ground.target.load import BUILTIN_TARGETS, load_tokenizer, target_folder, weights_digest

    name = "smollm2-135m"
    folder, _ = target_folder(name)  # dequantizes here first if this machine has not yet
    tokenizer, _ = load_tokenizer(name)
    with tempfile.TemporaryDirectory() as tmp:
        gguf = BUILTIN_TARGETS[name].locate(Path(tmp))
        bundle = out / "bundle"  # packed as bundle.tar, which the device unpacks into a folder of this name
        shutil.rmtree(bundle, ignore_errors=True)
        bundle.mkdir(parents=True)
        (bundle / "target.json").write_text(
            json.dumps({"name": name, "gguf_sha256": sha256_of(gguf), "weights_sha256": weights_digest(folder)}, indent=1) + "\n"
        )
        kept = write_conversations(bundle / "conversations.jsonl.xz", tokenizer, args.conversations)
        with open(bundle / "mt-bench.jsonl", "w", encoding="utf-8") as f:
            for prompt in load_prompts("mt-bench"):
                f.write(json.dumps({"id": prompt.id, "prompt": prompt.text}) + "\n")
        if not args.no_wheels:
            stage_wheels(bundle / "wheels", args.python_version)
        shutil.copy(gguf, bundle / "target.gguf")
    part_bytes = CALL_BYTES - checkout_bytes() - SPARE_BYTES
    manifest = send(bundle, out / "parts", part_bytes)
    shutil.rmtree(bundle)
    size, count, most = manifest["bytes"] / 2**20, len(manifest["parts"]), part_bytes / 2**20
    print(f"staged {out}: a bundle of {size:.1f} MiB ({kept} conversations) in {count} parts of at most {most:.1f} MiB")
    print(calls(out / "parts", manifest))
    return 0


def write_conversations(path: Path, tokenizer, limit: int) -> int:
    """The user turns of ShareGPT conversations, up to MAX_TURNS, each turn's own chat prompt at
    most MAX_PROMPT_TOKENS tokens (the conversation is cut before the first longer one, and left
    out when that is its first), first turns once each; xz-compressed JSON lines {id, turns}.
    Returns how many conversations."""
    from drafthead.inference.bench.prompts import encode_chat
    from drafthead.train.data.sources import sharegpt_chats

    seen, kept = set(), 0
    with lzma.open(path, "wt", encoding="utf-8") as f:
        for chat in sharegpt_chats():
            turns = []
            for text in [m["content"] for m in chat["messages"] if m["role"] == "user"][:MAX_TURNS]:
                if not text.strip() or encode_chat(tokenizer, text).shape[1] > MAX_PROMPT_TOKENS:
                    break
                turns.append(text)
            if not turns or turns[0] in seen:
                continue
            seen.add(turns[0])
            f.write(json.dumps({"id": chat["id"], "turns": turns}, ensure_ascii=False) + "\n")
            kept += 1
            if kept == limit:
                break
    return kept


def checkout_bytes() -> int:
    """What travels with every call besides carried paths: tracked and untracked-not-ignored
    files, and a shared/ folder where the checkout has one (the device tool's rule)."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], capture_output=True, check=True)
    files = {Path(name) for name in listed.stdout.decode().split("\0") if name}
    files |= set(Path("shared").rglob("*"))
    return sum(f.stat().st_size for f in files if f.is_file() and not f.is_symlink())


def calls(parts: Path, manifest: dict) -> str:
    """The device calls that carry the parts, in order: the one that completes them runs the phases."""
    lines = ["the GPU run, one device call a part, back to back (a machine goes back 30 s after a call):"]
    last = len(manifest["parts"]) - 1
    for i, part in enumerate(manifest["parts"]):
        carry = json.dumps([str(parts / MANIFEST), str(parts / part["name"])])
        timeout = 600 if i == last else 120
        lines.append(f'  {i + 1}. run(command="bash scripts/gpu/run.sh", carry={carry}, timeout_s={timeout})')
    lines.append("each call prints which parts the device holds and what to send next; the last one runs the phases (about 9 minutes)")
    return "\n".join(lines)


def stage_wheels(folder: Path, python_version: str) -> None:
    """WANTED and their dependencies for the image's Python, less IMAGE_HAS, into `folder`."""
    import tempfile

    platforms = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    with tempfile.TemporaryDirectory() as every:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "-q",
                "--only-binary",
                ":all:",
                "--python-version",
                python_version,
                "--implementation",
                "cp",
                *platforms,
                "-d",
                every,
                *WANTED,
            ],
            check=True,
        )
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        for wheel in Path(every).glob("*.whl"):
            if wheel.name.split("-")[0].lower() not in IMAGE_HAS:
                shutil.copy(wheel, folder / wheel.name)
        (folder / "wanted.txt").write_text("".join(f"{w}\n" for w in WANTED))  # what install.sh asks for


if __name__ == "__main__":
    sys.exit(main())
