#!/usr/bin/env python3
"""llama.cpp's own converter and loader on our EAGLE-3 export, for every tiny target family.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/interop/check_llamacpp_families.py \
        [--families llama,qwen3] [--out out/interop/llamacpp_families.json] [--drop norm.weight]

For each family of tests/tiny.py, in a temp folder of its own:
  1. the tiny target, saved with its tokenizer (tests/conftest.py `save_tiny_target`, 4 layers);
  2. a seeded random EAGLE-3 head on it (aux layers 1, 2, 3; draft vocab 64; the engines' Llama
     draft layer), saved in our format; no training: only the layout is checked (1 and 2 are
     scripts/interop/family_heads.py, the one head every per-family interop row runs);
  3. `export_head(..., "llama.cpp")`, or the one-line refusal the export gives;
  4. llama.cpp's `convert_hf_to_gguf.py <export> --target-model-dir <target> --outtype f32`, run
     on a scratch copy of the target's config.json with a small SentencePiece tokenizer.model (the
     converter writes the target's vocabulary into the draft GGUF and does not know the tiny
     byte-level BPE's pre-tokenizer, as in scripts/interop/fixtures_llamacpp.py);
  5. the GGUF loaded by libllama (`dh_load_model`, in a child process with llama.cpp's log on),
     which refuses a file with a tensor missing ("missing tensor ...") or one too many ("wrong
     number of tensors").

Recorded per family: the export's config and tensor names, the GGUF's (read with the `gguf` package), which
export tensors have no GGUF tensor under the converter's renaming (`dropped`) and which GGUF
tensors come from no export tensor (`added`), whether libllama loads it and its error line if not.
A markdown table goes to stdout, everything to --out as JSON. --drop removes a tensor from every
export before the converter sees it: the negative control, which libllama must refuse. libllama and the converter are the
ones `make llamacpp` builds (build/libllama/, or DRAFTHEAD_LIBLLAMA / --libllama).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # tests/: the tiny families and the target saver
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from family_heads import AUX_LAYERS, DRAFT_VOCAB, N_LAYERS, SKIPPED_BY_NAME, family_head  # noqa: E402  (beside this file)

# export tensor -> GGUF tensor, as llama.cpp's converter renames them (conversion/llama.py,
# LlamaModel with MODEL_ARCH.EAGLE3: midlayer.* -> model.layers.0.* -> blk.0.*; fc, hidden_norm
# and d2t by hand). None: the converter drops it (t2d, "not used at runtime").
GGUF_NAME = {
    "fc.weight": "fc.weight",
    "midlayer.input_layernorm.weight": "blk.0.attn_norm.weight",
    "midlayer.hidden_norm.weight": "blk.0.attn_norm_2.weight",
    "midlayer.post_attention_layernorm.weight": "blk.0.ffn_norm.weight",
    "midlayer.self_attn.q_proj.weight": "blk.0.attn_q.weight",
    "midlayer.self_attn.k_proj.weight": "blk.0.attn_k.weight",
    "midlayer.self_attn.v_proj.weight": "blk.0.attn_v.weight",
    "midlayer.self_attn.o_proj.weight": "blk.0.attn_output.weight",
    "midlayer.mlp.gate_proj.weight": "blk.0.ffn_gate.weight",
    "midlayer.mlp.up_proj.weight": "blk.0.ffn_up.weight",
    "midlayer.mlp.down_proj.weight": "blk.0.ffn_down.weight",
    "norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "d2t": "d2t",
    "t2d": None,
}

# the child that loads the GGUF: libllama's log goes to its stderr, its verdict to stdout
LOAD_CHILD = """
import json, sys
from drafthead.inference.llamacpp import lib
L = lib.load()
m = L.dh_load_model(sys.argv[1].encode())
res = {"loaded": bool(m)}
if m:
    res.update(n_layer=L.llama_model_n_layer(m), n_embd=L.llama_model_n_embd(m),
               n_vocab=L.llama_vocab_n_tokens(L.llama_model_get_vocab(m)))
    L.llama_model_free(m)
print(json.dumps(res))
"""


def one_line(text: str) -> str:
    return " ".join(str(text).split())


def sentencepiece_model() -> bytes:
    """A small char-level SentencePiece model (the converter pads it to the target's vocab size)."""
    import sentencepiece as spm

    text = ["the quick brown fox jumps over the lazy dog 0123456789"] * 8
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(text),
        model_writer=buf,
        model_type="char",
        vocab_size=64,
        hard_vocab_limit=False,
        num_threads=1,
        unk_id=0,
        bos_id=-1,
        eos_id=1,
        pad_id=2,
        minloglevel=2,
    )
    return buf.getvalue()


def converter_target(target_dir: Path, folder: Path, sp_model: bytes) -> Path:
    """The target as the converter reads it for a draft: its config.json (vocab size, layers,
    hidden size) and a tokenizer.model; the BPE tokenizer files stay out, so the converter takes
    the SentencePiece path."""
    folder.mkdir()
    for name in ("config.json", "generation_config.json"):
        if (target_dir / name).exists():
            (folder / name).symlink_to((target_dir / name).resolve())
    (folder / "tokenizer.model").write_bytes(sp_model)
    return folder


def safetensors_names(folder: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return sorted(f.keys())


def gguf_names(path: Path) -> tuple[list[str], dict]:
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    arch = reader.fields.get("general.architecture")
    meta = {"architecture": arch.contents() if arch is not None else None}
    for key, field in reader.fields.items():  # the draft's hyperparameters, as llama.cpp reads them
        if key.startswith(f"{meta['architecture']}."):
            value = field.contents()
            meta[key.split(".", 1)[1]] = list(value) if isinstance(value, (list, tuple)) else value
    return sorted(t.name for t in reader.tensors), meta


def convert(export_dir: Path, target_dir: Path, out: Path, timeout: int) -> tuple[bool, str]:
    from drafthead.inference.llamacpp.convert import converter

    cmd = [sys.executable, str(converter()), str(export_dir), "--target-model-dir", str(target_dir), "--outtype", "f32", "--outfile", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if p.returncode == 0 and out.is_file():
        return True, ""
    errors = [ln for ln in p.stderr.splitlines() if "Error" in ln or "error" in ln] or p.stderr.splitlines()[-1:]
    return False, one_line(errors[-1] if errors else f"exit {p.returncode}")


def load(gguf_path: Path, timeout: int) -> dict:
    """libllama on the GGUF in a child process (an abort in llama.cpp stays there)."""
    env = {**os.environ, "DRAFTHEAD_LLAMA_VERBOSE": "1", "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-c", LOAD_CHILD, str(gguf_path)], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    res = {"loaded": False}
    for line in reversed(p.stdout.splitlines()):
        if line.startswith("{"):
            res = json.loads(line)
            break
    log = p.stderr.splitlines()
    counted = [ln for ln in log if "loaded meta data with" in ln]
    if counted:  # "... with K key-value pairs and N tensors from ..."
        words = counted[0].split()
        res["tensors_in_file"] = int(words[words.index("tensors") - 1])
    if not res["loaded"]:
        errors = (
            [ln for ln in log if "error loading model" in ln or "wrong number of tensors" in ln or "missing tensor" in ln]
            or [ln for ln in log if "error" in ln.lower()]
            or log[-1:]
        )
        res["error"] = one_line(errors[0]) if errors else f"child exited {p.returncode}"
        res["returncode"] = p.returncode
    return res


def drop_tensor(export_dir: Path, name: str) -> None:
    """Rewrite the export's weights without `name` (the negative control's damage)."""
    from safetensors.torch import load_file, save_file

    weights = export_dir / "model.safetensors"
    tensors = load_file(str(weights))
    del tensors[name]
    save_file(tensors, str(weights))


def check_family(family: str, sp_model: bytes, timeout: int, drop: str | None = None) -> dict:
    from drafthead.heads.formats import export_head

    row: dict = {"family": family}
    start = time.time()
    with tempfile.TemporaryDirectory(prefix=f"lcf-{family}-") as t:
        work = Path(t)
        target_dir, head_dir, model = family_head(family, work)
        row["target"] = {
            "model_type": model.config.model_type,
            "architecture": type(model).__name__,
            "vocab_size": model.config.vocab_size,
            "layers": N_LAYERS,
        }
        try:
            export_dir = export_head(head_dir, work / "export", "llama.cpp", target_model=model, overwrite=True)
        except ValueError as e:
            row.update(status="refused by our export", refusal=one_line(e))
            row["seconds"] = round(time.time() - start, 1)
            return row
        if drop:
            drop_tensor(export_dir, drop)
        exported = safetensors_names(export_dir)
        row["exported"] = exported
        row["export_config"] = json.loads((export_dir / "config.json").read_text())
        unknown = [n for n in exported if n not in GGUF_NAME]
        ok, error = convert(export_dir, converter_target(target_dir, work / "converter-target", sp_model), work / "draft.gguf", timeout)
        if not ok:
            row.update(status="converter failed", error=error, unknown_to_check=unknown)
            row["seconds"] = round(time.time() - start, 1)
            return row
        names, meta = gguf_names(work / "draft.gguf")
        mapped = {GGUF_NAME.get(n) for n in exported}
        row.update(
            gguf=names,
            gguf_meta=meta,
            unknown_to_check=unknown,
            dropped=sorted(n for n in exported if GGUF_NAME.get(n) not in names),
            added=sorted(n for n in names if n not in mapped),
        )
        row["loader"] = load(work / "draft.gguf", timeout)
        clean = not row["added"] and set(row["dropped"]) <= SKIPPED_BY_NAME and not unknown
        row["status"] = "loads" if row["loader"]["loaded"] else "libllama refuses"
        if not clean:
            row["status"] += ", tensors differ"
    row["seconds"] = round(time.time() - start, 1)
    return row


def table(rows: list[dict]) -> str:
    lines = [
        "| family | our export | exported tensors | GGUF tensors | dropped by the converter | added | libllama loads | note |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        if "refusal" in r:
            lines.append(f"| {r['family']} | refused | - | - | - | - | - | {r['refusal'].replace('|', '/')} |")
            continue
        if "exported" not in r:
            why = f"{r['status']}: {r.get('error', '')}".replace("|", "/")
            lines.append(f"| {r['family']} | - | - | - | - | - | - | {why} |")
            continue
        n_gguf = len(r["gguf"]) if "gguf" in r else "-"
        loader = r.get("loader", {})
        loads = "-" if not loader else ("yes" if loader["loaded"] else "NO")
        note = r.get("error") or loader.get("error") or ""
        if loader.get("loaded"):  # the draft's geometry as the GGUF tells llama.cpp
            m = r["gguf_meta"]
            rope = f"RoPE base {m['rope.freq_base']:.0f}" if "rope.freq_base" in m else "RoPE base default"
            if m.get("rope.scaling.type"):
                rope += f" ({m['rope.scaling.type']} x{m.get('rope.scaling.factor', 1):g})"
            note = (
                f"{loader.get('tensors_in_file', '?')} tensors read; hidden {loader.get('n_embd')}, heads "
                f"{m.get('attention.head_count')}/{m.get('attention.head_count_kv')} x "
                f"{m.get('attention.key_length')}, {rope}; target layers {m.get('target_layers')}"
            )
        dropped = ", ".join(r.get("dropped", [])) or "none"
        added = ", ".join(r.get("added", [])) or "none"
        lines.append(f"| {r['family']} | written | {len(r['exported'])} | {n_gguf} | {dropped} | {added} | {loads} | {note.replace('|', '/')} |")
    return "\n".join(lines)


def versions() -> dict:
    from drafthead.inference.llamacpp import lib
    from drafthead.inference.llamacpp.convert import converter

    libdir = lib.library_dir()
    conv = converter()
    gguf_py = conv.parent / "gguf-py" / "pyproject.toml"
    gguf_version = None
    if gguf_py.is_file():
        for line in gguf_py.read_text().splitlines():
            if line.startswith("version"):
                gguf_version = line.split("=", 1)[1].strip().strip('"')
                break
    sdist = sorted(p.name for p in libdir.parent.glob("llama_cpp_python-*") if p.is_dir())
    return {"libllama": str(libdir), "converter": str(conv), "llama_cpp_source": sdist, "converter_gguf_py": gguf_version}


def main(argv=None) -> int:
    from tests.tiny import FAMILIES

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--families", default=",".join(FAMILIES), help=f"comma-separated subset of {','.join(FAMILIES)}")
    p.add_argument("--out", default=str(ROOT / "out" / "interop" / "llamacpp_families.json"))
    p.add_argument("--libllama", help="folder holding libdrafthead_llama.so (default: $DRAFTHEAD_LIBLLAMA, else build/libllama/lib)")
    p.add_argument("--timeout", type=int, default=600, help="seconds per converter / loader run")
    p.add_argument("--drop", help="a tensor to remove from every export first (the negative control)")
    args = p.parse_args(argv)
    if args.libllama:
        os.environ["DRAFTHEAD_LIBLLAMA"] = str(Path(args.libllama).resolve())
    torch.set_num_threads(1)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    families = [f for f in args.families.split(",") if f]
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        p.error(f"unknown families {unknown} (known: {', '.join(FAMILIES)})")
    from drafthead.inference.llamacpp import lib

    why = lib.why_unavailable()
    if why:
        print(why, file=sys.stderr)
        return 2
    sp_model = sentencepiece_model()
    rows = []
    for family in families:
        try:
            rows.append(check_family(family, sp_model, args.timeout, args.drop))
        except Exception as e:  # one family's failure is a row
            error = one_line(f"{type(e).__name__}: {e}")[-400:]
            rows.append({"family": family, "status": "check failed", "error": error})
        print(f"[llamacpp-families] {family}: {rows[-1]['status']}", file=sys.stderr, flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "date": time.strftime("%Y-%m-%d", time.gmtime()),
                "versions": versions(),
                "aux_layers": list(AUX_LAYERS),
                "draft_vocab_size": DRAFT_VOCAB,
                "families": rows,
            },
            indent=1,
        )
        + "\n"
    )
    print(table(rows))
    good = all(r["status"] in ("loads", "refused by our export") for r in rows)
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
