"""llama.cpp's own command-line decoding, for comparison with ours on the same GGUF
(`drafthead bench --compare llama.cpp`): plain greedy decoding (llama-completion), its n-gram
drafting and its EAGLE-3 drafting with our head (llama-speculative-simple), built by
`make llamacpp` beside libllama. Each returns {"tokens", "seconds", "text"}; seconds are the
tool's own timers of the whole generation, prefill included and model load excluded, as ours are
timed.
`llama_server` runs its OpenAI-compatible server, which `data regenerate --server` asks.
"""

from __future__ import annotations

import re
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

from . import lib as _lib
from ..servers.local import local_server
from .convert import ConversionError, converter


PLAIN_ROW = "llama.cpp plain"
NGRAM_ROW = "llama.cpp n-gram (ngram-simple, n=3)"
EAGLE3_ROW = "llama.cpp draft-eagle3 (our head, 4 drafts)"


def tool(name: str) -> Path:
    path = _lib.library_dir().parent / "cmake" / "bin" / name
    if not path.is_file():
        raise _lib.LibllamaMissing(f"llama.cpp's {name} is not built at {path} (run `make llamacpp`)")
    return path


def _common(threads: int, context: int) -> list[str]:
    return ["-t", str(threads), "-tb", str(threads), "-c", str(context), "--temp", "0", "--top-k", "1", "--seed", "0", "--no-escape"]


def _number(pattern: str, log: str, name: str) -> float:
    m = re.search(pattern, log)
    if m is None:
        raise RuntimeError(f"llama.cpp's output has no {name} ({pattern!r}):\n{log[-600:]}")
    return float(m.group(1))


def _run(cmd: list) -> subprocess.CompletedProcess:
    done = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, errors="replace", timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"{Path(str(cmd[0])).name} failed (rc {done.returncode}):\n{done.stderr[-800:]}")
    return done


def plain(gguf: Path, text: str, n: int, threads: int, context: int = 4096) -> dict:
    done = _run([tool("llama-completion"), "-m", gguf, "-p", text, "-n", n, "-no-cnv", "--no-display-prompt", *_common(threads, context)])
    log = done.stderr
    # its "total time": prompt, decode steps, sampling and the rest of its loop, model load
    # excluded: the wall clock ours is timed by
    total_ms = _number(r"total time =\s*([\d.]+) ms", log, "total time")
    runs = _number(r"(?<!prompt )eval time =\s*[\d.]+ ms /\s*(\d+) runs", log, "run count")
    # the first new token comes out of the prompt pass, the others from `runs` decode steps
    return {"tokens": int(runs) + 1, "seconds": total_ms / 1000, "text": done.stdout}


def _speculative(gguf: Path, text: str, n: int, threads: int, extra: list, context: int) -> dict:
    done = _run([tool("llama-speculative-simple"), "-m", gguf, "-p", text, "-n", n, *extra, *_common(threads, context)])
    log = done.stderr
    encode = _number(r"encoded\s+\d+ tokens in\s+([\d.]+) seconds", log, "encode time")
    decode = _number(r"decoded\s+\d+ tokens in\s+([\d.]+) seconds", log, "decode time")
    tokens = _number(r"decoded\s+(\d+) tokens in", log, "token count")
    return {"tokens": int(tokens), "seconds": encode + decode, "text": done.stdout}


def ngram(gguf: Path, text: str, n: int, threads: int, context: int = 4096) -> dict:
    return _speculative(gguf, text, n, threads, ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3"], context)


def eagle3(gguf: Path, draft: Path, text: str, n: int, threads: int, k: int = 4, context: int = 4096) -> dict:
    return _speculative(
        gguf,
        text,
        n,
        threads,
        [
            "-md",
            draft,
            "--spec-type",
            "draft-eagle3",
            "--spec-draft-n-max",
            str(k),
            "--spec-draft-p-min",
            "0",
            "--spec-draft-threads",
            str(threads),
            "--spec-draft-threads-batch",
            str(threads),
        ],
        context,
    )


def head_gguf(head: Path, target_folder: Path, out: Path) -> Path:
    """Our EAGLE-3 head as llama.cpp's draft GGUF: exported in the llama.cpp layout
    (heads/formats), then converted by llama.cpp's converter against the target's folder."""
    from ...heads.formats import export_head

    if out.is_file() and out.stat().st_mtime >= max(f.stat().st_mtime for f in Path(head).iterdir()):
        return out
    folder = out.with_suffix(".export")
    export_head(head, folder, "llama.cpp", overwrite=True)
    tmp = out.with_suffix(".tmp")
    done = subprocess.run(
        [sys.executable, str(converter()), str(folder), "--target-model-dir", str(target_folder), "--outtype", "f32", "--outfile", str(tmp)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise ConversionError(f"llama.cpp's converter failed on the head export {folder}:\n{done.stderr[-600:]}")
    tmp.replace(out)
    return out


def compare_rows(
    target_folder: Path,
    gguf_type: str,
    texts: list[str],
    n: int,
    threads: int,
    eagle3_head: Path | None = None,
    work: Path | None = None,
    progress: bool = True,
) -> dict:
    """{engine name: one record per text}: llama.cpp plain, its n-gram drafting and (given an
    EAGLE-3 head of ours) its draft-eagle3, prompt by prompt on the target's GGUF."""
    from tqdm.auto import tqdm

    from .convert import target_gguf

    gguf = target_gguf(target_folder, gguf_type)
    runs = {PLAIN_ROW: lambda text: plain(gguf, text, n, threads), NGRAM_ROW: lambda text: ngram(gguf, text, n, threads)}
    if eagle3_head is not None:
        draft = head_gguf(eagle3_head, target_folder, (work or gguf.parent) / f"head-{Path(eagle3_head).name}.gguf")
        runs[EAGLE3_ROW] = lambda text: eagle3(gguf, draft, text, n, threads)
    rows: dict[str, list[dict]] = {name: [] for name in runs}
    for text in tqdm(texts, desc="llama.cpp", unit="prompt", disable=not progress):
        for name, run in runs.items():
            rows[name].append(run(text))
    return rows


@contextmanager
def llama_server(gguf: Path, *, threads: int, context: int = 4096, slots: int = 1, log: Path | None = None, ready_within: float = 120.0):
    """llama-server on 127.0.0.1 serving `gguf`, up (its /health answers 200) inside the block, which
    gets its URL; stopped on the way out. --jinja: the GGUF's own chat template, rendered as the
    tokenizer's is; `slots` requests are answered at once, each with context // slots positions."""

    flags = ["-t", threads, "-tb", threads, "-c", context, "-np", slots, "--jinja", "--no-webui", "--seed", "0"]

    def cmd(port):
        return [tool("llama-server"), "-m", gguf, "--host", "127.0.0.1", "--port", port, *flags]

    with local_server(cmd, "llama-server", log=log, ready_within=ready_within) as url:
        yield url
