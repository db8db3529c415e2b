"""Stage what the GPU check needs into a folder the device tool carries (64 MiB at most): the
SmolLM2-135M target's config and tokenizer (no weights: the check builds a target of its shapes
with random weights), 256 ShareGPT chats, 8 MT-bench prompts, and (unless --no-wheels) the wheels
of the packages drafthead needs that the GPU image lacks or holds at other versions.

    .venv/bin/python scripts/gpu/stage.py --out .gpu        # here, once; .gpu is git-ignored
    scripts/gpu/check.sh                                      # there, with .gpu carried

Why no weights: SmolLM2-135M's are 270 MB in bf16, four times what one run may carry. Speed and
memory depend on the target's shapes, not its values; exactness on the device is checked by
tests/test_cuda.py on tiny targets, and acceptance by the CPU's runs on the real weights.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=".gpu")
    p.add_argument("--chats", type=int, default=256)
    p.add_argument("--no-wheels", action="store_true", help="the CPU dry run: its venv has every package")
    p.add_argument("--python-version", default="3.12", help="the GPU image's Python (docs/testing.md)")
    args = p.parse_args(argv)

    from drafthead.inference.bench.prompts import load_prompts
    from drafthead.inference.engine.targets import target_folder
    from drafthead.train.source_report import SourceReport
    from drafthead.train.sources import iter_conversations, sharegpt_path

    out = Path(args.out)
    (out / "smollm2").mkdir(parents=True, exist_ok=True)
    folder, _ = target_folder("smollm2-135m")
    for file in folder.iterdir():  # config, tokenizer and chat template; not the weights
        if file.is_file() and file.suffix != ".safetensors" and not file.name.startswith("drafthead_"):
            shutil.copy(file, out / "smollm2" / file.name)
    chats = iter_conversations(sharegpt_path(), "json", SourceReport(source="sharegpt"), args.chats)
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


if __name__ == "__main__":
    sys.exit(main())
